"""Drives a swaserve Runtime step by step for the GPU tests (the scheduler loop of Engine.step, greedy,
no detokenizer), poisons free KV slots, reads back live requests' K/V and records JSON results."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from swaserve.scheduler.batch import ScheduleBatch
from swaserve.scheduler.integrity import owned_slots
from swaserve.scheduler.req import Req


class Params:  # the SamplingParams fields the scheduler reads
    def __init__(self, max_tokens: int):
        self.max_tokens, self.ignore_eos, self.stop_token_ids = max_tokens, True, []
        self.prompt_logprobs = None


def make_req(rid: str, ids: list[int], max_tokens: int) -> Req:
    return Req(rid, rid, 0, len(ids), list(ids), Params(max_tokens), 0, frozenset())


def forward(rt: Any, device: str) -> tuple[ScheduleBatch, torch.Tensor]:
    """Schedule and run one step. Returns the batch and the float32 logits `[n_sampling, vocab]` of
    the rows that sample, as a copy: a graph replay's output buffer is overwritten by the next one."""
    batch = rt.scheduler.schedule()
    assert batch is not None, "scheduler has unfinished requests but scheduled nothing"
    logits = rt.runner.forward(batch.to_forward_batch(device, host_decode_inputs=True))
    idx = batch.sample_indices()
    return batch, logits[idx] if idx else logits[:0].clone()


def count_replays(rt: Any) -> list[tuple[int, int]]:
    """Wrap the graph runner's replay to record (raw_bs, captured_bs) of every replay."""
    from swaserve.runner.graph_buffers import padded_batch_size

    gr = rt.runner.graph_runner
    seen: list[tuple[int, int]] = []
    replay = gr.replay

    def counted(batch: Any) -> torch.Tensor:
        seen.append((batch.batch_size, padded_batch_size(batch.batch_size, gr.sizes)))
        return replay(batch)

    gr.replay = counted
    return seen


def poison_free_slots(rt: Any) -> None:
    """NaN into every KV slot no request owns (slot 0 included) in both pools, so a live row that
    reads a freed, evicted or dummy slot produces NaN instead of a plausible value."""
    owned = owned_slots(rt.scheduler)  # [n] int64, cpu: full-pool slots of every request
    keep_full = torch.zeros(rt.kv.full.size + 1, dtype=torch.bool)
    keep_full[owned] = True
    pools = [(rt.kv.full, keep_full)]
    if rt.kv.swa is not None:
        swa = rt.allocator.full_to_swa[owned]
        keep_swa = torch.zeros(rt.kv.swa.size + 1, dtype=torch.bool)
        keep_swa[swa[swa > 0]] = True
        pools.append((rt.kv.swa, keep_swa))
    for pool, keep in pools:
        free = (~keep).nonzero().flatten().to(pool.device)
        for i in range(pool.num_layers):
            pool.k_buffer(i).index_fill_(0, free, float("nan"))
            pool.v_buffer(i).index_fill_(0, free, float("nan"))


def live_kv(rt: Any) -> tuple[list[str], list[tuple[str, torch.Tensor, list[int]]]]:
    """K/V of every running request, requests in rid order: the full pool at all its positions and
    the SWA pool inside its window (positions not yet evicted).

    Returns (rids, [(name, rows, bounds)]): one entry per pool, layer and K/V; request i owns rows
    `bounds[i]:bounds[i+1]` of `rows`.
    """
    reqs = sorted(rt.scheduler.running, key=lambda r: r.rid)
    full = [rt.req_to_token.slots(r.row, 0, r.kv_len) for r in reqs]  # each [kv_len] int64, cpu
    parts = [("full", rt.kv.full, full, lambda s: s)]
    if rt.kv.swa is not None:
        win = [f[r.swa_evicted:] for f, r in zip(full, reqs)]
        parts.append(("swa", rt.kv.swa, win, lambda s: rt.allocator.full_to_swa[s]))
    out = []
    for name, pool, slots, to_pool in parts:
        bounds = [0]
        for s in slots:
            bounds.append(bounds[-1] + s.numel())
        idx = to_pool(torch.cat(slots)) if slots else torch.empty(0, dtype=torch.int64)
        assert bool((idx > 0).all()), f"a live {name} position has no slot (unmapped or evicted too early)"
        idx = idx.to(pool.device)
        for i in range(pool.num_layers):
            out.append((f"{name}.k{i}", pool.k_buffer(i)[idx], bounds))
            out.append((f"{name}.v{i}", pool.v_buffer(i)[idx], bounds))
    return [r.rid for r in reqs], out


def record(result: dict[str, Any]) -> None:
    """Print one JSON line (visible with -s) and append it to $SWASERVE_GPU_REPORT if set, which
    scripts/gpu_check.sh shows at the end of its run."""
    line = json.dumps(result, sort_keys=True)
    print(line, flush=True)
    path = os.environ.get("SWASERVE_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
