"""Eagle3Drafter: an EAGLE-3 head (`models/llama_eagle3.py`) drafting from the target's own states. The
target keeps the residual stream entering three of its layers (`aux_hidden_layers`); the head's K/V
entry at position t is computed from those states at t and the embedding of token t + 1, in its own
one-layer cache (`DraftCache`). Each step it catches up on the positions the target confirmed (one
extend forward), then chains k - 1 decode steps on its own pre-norm output."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swaserve.models.llama_eagle3 import AUX_INPUT, EAGLE3_ARCHITECTURES, HIDDEN_INPUT, PRENORM, Eagle3Head
from swaserve.runner.forward_batch import ForwardMode
from swaserve.speculative.draft_cache import DraftCache, DraftRow
from swaserve.speculative.verify import speculates

if TYPE_CHECKING:
    from swaserve.config import ModelConfig, SchedulerConfig, SpeculativeConfig
    from swaserve.runtime import Runtime
    from swaserve.scheduler.req import Req

# Target states waiting for the token after them are folded into the head's cache once this many
# are ready (a prefill chunk, or decode steps while speculation is off for a large batch), so what a
# sequence holds back stays small.
FLUSH_ROWS = 16


@dataclass
class _HeadSeq:
    cache: DraftRow  # entry j holds the K/V of sequence position base + j
    base: int  # the first position the target's states were seen for (> 0 after a prefix-cache hit)
    exact: int = 0  # entries [0, exact) come from the target's states; later ones from the last drafts
    pending: list[torch.Tensor] = field(default_factory=list)  # [n_i, 3 * target hidden] of positions base + exact ..
    num_pending: int = 0


class Eagle3Drafter:
    """Owns the head's runtime and one `_HeadSeq` per speculating request. Invariants: for a tracked
    request, `base + exact + num_pending` is the number of positions the target has shown states for,
    and entry j < exact of its row holds K/V of (state at base + j, embedding of ids[base + j + 1])."""

    def __init__(self, rt: Runtime, head: Eagle3Head, layers: tuple[int, ...]):
        self.rt, self.head, self.layers = rt, head, layers
        self.cache = DraftCache(rt)
        self.seqs: dict[str, _HeadSeq] = {}

    @classmethod
    def build(cls, cfg: SpeculativeConfig, target: ModelConfig, device: torch.device, dtype: torch.dtype,
              target_sched: SchedulerConfig, load_format: str) -> Eagle3Drafter:
        from swaserve.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
        from swaserve.loader.hf_dir import load_hf_config
        from swaserve.runtime import build_runtime

        path = cfg.speculative_draft_model
        if path is None:
            raise ValueError("speculative_method eagle3 needs speculative_draft_model: an EAGLE-3 head's HF directory")
        hf = load_hf_config(path)
        arch = (getattr(hf, "architectures", None) or [None])[0]
        if arch not in EAGLE3_ARCHITECTURES:
            raise ValueError(f"{path} is not an EAGLE-3 head (architectures {arch!r}; expected one of "
                             f"{', '.join(EAGLE3_ARCHITECTURES)})")
        if hf.num_hidden_layers != 1:
            raise ValueError(f"EAGLE-3 heads with {hf.num_hidden_layers} decoder layers are not supported (1 only)")
        thf = target.hf_config
        target_hidden = int(getattr(hf, "target_hidden_size", None) or hf.hidden_size)
        if target_hidden != thf.hidden_size:
            raise ValueError(f"the EAGLE-3 head expects a target of hidden size {target_hidden}; this target's is "
                             f"{thf.hidden_size}")
        if hf.vocab_size != target.vocab_size:
            raise ValueError(f"the EAGLE-3 head's vocabulary ({hf.vocab_size}) differs from the target's "
                             f"({target.vocab_size})")
        layers = aux_layers(hf, target.num_layers)
        weights = None if load_format == "dummy" else dict(_head_weights(Path(path)))
        has_embed = weights is not None and any(n.removeprefix("model.") == "embed_tokens.weight" for n in weights)
        if not has_embed and hf.hidden_size != thf.hidden_size:
            raise ValueError("the EAGLE-3 head has no embed_tokens and its hidden size differs from the target's")
        hf.sliding_window, hf.layer_types = None, None  # one full-attention layer
        with torch.device("meta"):
            head = Eagle3Head(hf, target_hidden, has_embed)
        head = head.to(dtype=dtype).to_empty(device=device).eval()
        if weights is None:
            from swaserve.loader.dummy import init_dummy_weights

            init_dummy_weights(head)
            head.d2t.zero_()
        else:
            head.load_weights(weights.items())
        config = ModelConfig.from_hf(hf, max_context=target.max_context)
        sched = SchedulerConfig(max_running_requests=target_sched.max_running_requests,
                                max_prefill_tokens=target_sched.max_prefill_tokens, max_context=target.max_context)
        group = config.full_group
        per_token = group.num_kv_heads * (group.k_head_dim + group.v_head_dim)
        need = (sched.max_running_requests + 1) * target.max_context * per_token
        budget = min((256 << 20) if device.type == "cpu" else (4 << 30), 2 * need * dtype.itemsize + (8 << 20))
        cache = CacheConfig(kv_cache_bytes=budget, disable_prefix_cache=True)
        # No decode graphs: a captured forward would freeze the state input it reads from the batch.
        runner = RunnerConfig(disable_cuda_graph=True)
        return cls(build_runtime(config, head, device, dtype, cache, sched, runner), head, layers)

    def attach(self, rt: Runtime) -> None:
        """Make the target keep the states of `layers` (before its decode graphs are captured) and, for
        a head without its own, share the target's embedding table (unscaled, as EAGLE-3 trains it)."""
        stack = rt.runner.model.model
        if not hasattr(stack, "aux_hidden_layers"):
            raise ValueError(f"{type(rt.runner.model).__name__} does not keep auxiliary states for EAGLE-3")
        stack.aux_hidden_layers = self.layers
        if self.head.embed_tokens is None:
            from swaserve.layers.embedding import VocabEmbedding

            with torch.device("meta"):
                embed = VocabEmbedding(self.head.hf_config.vocab_size, self.head.hidden_size)
            embed.weight = stack.embed_tokens.weight
            self.head.embed_tokens = embed

    # -- the drafter interface ---------------------------------------------------------------

    def observe(self, reqs: list[Req], states: torch.Tensor, offsets: list[int], counts: list[int]) -> None:
        """Keep the target's states of each speculating request's confirmed tokens; fold those whose
        next token is known into the head's cache once FLUSH_ROWS are ready."""
        assert states.shape[1] == self.head.fc.in_features, "the target keeps no auxiliary states (attach first)"
        due = []
        for r, off, n in zip(reqs, offsets, counts):
            if n == 0 or not speculates(r.params):
                continue
            seq = self.seqs.get(r.rid)
            if seq is None:  # its first step is a prefill chunk, whose K/V length counts it already
                row = self.cache.open(r.rid)
                if row is None:
                    raise RuntimeError("the EAGLE-3 head's request table is full")  # sized like the target's
                seq = self.seqs[r.rid] = _HeadSeq(row, base=r.kv_len - n)
            seq.pending.append(states[off : off + n].clone())
            seq.num_pending += n
            if self._ready(seq, r) >= FLUSH_ROWS:
                due.append(r)
        if due:
            self._extend(due)

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        live = []
        for r, k in zip(reqs, ks):
            seq = self.seqs.get(r.rid)
            if k > 0 and seq is not None and self._ready(seq, r) > 0:
                assert seq.base + seq.exact + seq.num_pending == len(r.ids) - 1, "states of every K/V position seen"
                live.append((r, k))
        drafts: dict[str, list[int]] = {}
        if live:
            hidden, g = self._extend([r for r, _ in live])
            for (r, _), t in zip(live, self.rt.runner.greedy_tokens(hidden).tolist()):
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

    # -- the head's cache ----------------------------------------------------------------------

    @staticmethod
    def _ready(seq: _HeadSeq, r: Req) -> int:
        """Pending positions whose next token is known (t + 1 < len(ids))."""
        return max(0, min(seq.num_pending, len(r.ids) - 1 - seq.base - seq.exact))

    def _extend(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
        """One extend forward over each request's ready positions (the last drafts' entries dropped
        first): the normed and pre-norm states `[len(reqs), hidden]` of each one's last position."""
        rows, ids, positions, aux = [], [], [], []
        for r in reqs:
            seq = self.seqs[r.rid]
            n = self._ready(seq, r)
            self.cache.truncate(seq.cache, seq.exact)
            states = torch.cat(seq.pending) if len(seq.pending) > 1 else seq.pending[0]
            aux.append(states[:n])
            seq.pending = [states[n:]] if n < seq.num_pending else []
            seq.num_pending -= n
            start = seq.base + seq.exact
            rows.append(seq.cache)
            ids.append(r.ids[start + 1 : start + n + 1])
            positions.append(list(range(start, start + n)))
            seq.exact += n
        batch = self.cache.batch(ForwardMode.EXTEND, rows, ids, positions)
        batch.scratch[AUX_INPUT] = torch.cat(aux)
        hidden = self.rt.runner.forward_hidden(batch)
        self.cache.evict(rows)
        return hidden, batch.scratch[PRENORM][batch.last_token_indices()]

    def _chain(self, reqs: list[Req], inputs: list[int], g: torch.Tensor, step: int) -> tuple[torch.Tensor, list[int]]:
        """Draft step `step` >= 1: each request's previous draft `inputs[i]` at position len(ids) - 2 + step,
        the head's own pre-norm state `g` standing in for the target's; (new pre-norm states, drafts)."""
        seqs = [self.seqs[r.rid] for r in reqs]
        positions = [[len(r.ids) - 2 + step] for r in reqs]
        assert all(s.base + s.cache.length == p[0] for s, p in zip(seqs, positions))
        batch = self.cache.batch(ForwardMode.DECODE, [s.cache for s in seqs], [[t] for t in inputs], positions)
        batch.scratch[HIDDEN_INPUT] = g
        hidden = self.rt.runner.forward_hidden(batch)
        return batch.scratch[PRENORM], self.rt.runner.greedy_tokens(hidden).tolist()


def aux_layers(hf: Any, num_layers: int) -> tuple[int, ...]:
    """The target layers whose entering residual stream the head reads: the config's
    `eagle_aux_hidden_state_layer_ids` name layer outputs (so the input of the next layer), else
    (2, L // 2, L - 3)."""
    eagle = getattr(hf, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    layers = tuple(int(i) + 1 for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(layers) != 3 or not all(0 <= i <= num_layers for i in layers):
        raise ValueError(f"EAGLE-3 auxiliary layers {layers} do not fit a target of {num_layers} layers")
    return layers


def _head_weights(path: Path):
    """(name, tensor) pairs of a head directory: safetensors, else pytorch_model.bin."""
    from swaserve.loader.safetensors import iter_safetensors, safetensors_files

    if safetensors_files(path):
        yield from iter_safetensors(path)
        return
    bin_file = path / "pytorch_model.bin"
    if not bin_file.is_file():
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin weights in {path}")
    yield from torch.load(bin_file, map_location="cpu", weights_only=True).items()
