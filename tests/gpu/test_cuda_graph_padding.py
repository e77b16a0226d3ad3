"""Decode through CudaGraphRunner (triton backend) with batches that shrink and grow — 12 -> 9 -> 3 ->
5 -> 12 and 256 -> 200 -> 37 -> 256 -> 37 — against an identical eager triton engine: same greedy
tokens, and after every step the same K/V for every live request in both pools. Every free slot and
slot 0 is re-poisoned with NaN after each step, so a live row reading anything it does not own shows.

Stale rows are built in: each shrink runs in a captured size that the previous, larger batch filled
(12 and 9 both run as 16; 200 as 208 after 256), and the requests that finish first sit at the front
of the batch, so the static buffers' tail rows still hold write slots of requests that are live.
"""

from __future__ import annotations

import bisect
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny HF families
from engine_driver import count_replays, forward, live_kv, make_req, poison_free_slots, record
from families import make_hf_model

from swaserve.config import CacheConfig, RunnerConfig, SchedulerConfig
from swaserve.loader.hf_dir import load_model_from_dir
from swaserve.runtime import build_runtime

pytestmark = pytest.mark.gpu
DEV = "cuda"
# Bit-identical to eager is the goal, and every kernel here is row-independent; but a padded batch
# runs its GEMMs at another M (16 rows instead of 9), for which cuBLAS may pick a kernel with another
# summation order. So by default the check is a tight tolerance plus "no NaN anywhere live", with
# bit-identity measured per step and reported; SWASERVE_GPU_EXACT=1 asserts it.
EXACT = os.environ.get("SWASERVE_GPU_EXACT") == "1"
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 5e-2, "atol": 5e-2}}
VOCAB = 160  # families.COMMON


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma3_tiny")
    make_hf_model("gemma3", path, seed=3)  # window 8: decodes cross it many times
    return path


def make_runtime(path: Path, graphs: bool, dtype: torch.dtype, max_reqs: int, prefill: int,
                 cache: CacheConfig):
    config, model = load_model_from_dir(path, DEV, dtype)
    # prefill_first: the designed batch sizes (mixed steps would prefill newcomers next to the decodes,
    # through the eager extend path, and the decode-graph sizes would follow the chunking instead).
    sched = SchedulerConfig(max_running_requests=max_reqs, max_prefill_tokens=prefill, schedule_policy="prefill_first")
    # Decode graphs only: extend steps run eagerly in both engines. (With extend graphs, on by default since
    # issue 39, the graph engine's prefills take the unified kernel, which in the default mode is not the
    # eager extend kernel: in bf16 the third layer's SWA K differed by 0.066 after a 7-request prefill, beyond
    # this test's tolerance, on an H200, 2026-11-29; tests/gpu/test_piecewise_gpu.py compares those steps with eager.)
    runner = RunnerConfig(attention_backend="triton", disable_cuda_graph=not graphs, enable_piecewise_cuda_graph=False)
    rt = build_runtime(config, model, torch.device(DEV), dtype, cache, sched, runner)
    gr = rt.runner.graph_runner
    if graphs:
        assert type(gr).__name__ == "CudaGraphRunner" and gr.sizes[-1] == max_reqs, gr
    else:
        assert gr is None
    poison_free_slots(rt)  # after capture: the warm-ups wrote slot 0
    return rt


class Lockstep:
    """Steps an eager and a graph engine on the same requests; both commit eager's greedy tokens, so
    a near-tie flip cannot desynchronise them, but any other disagreement fails the step."""

    def __init__(self, eager, graph, dtype: torch.dtype, seed: int):
        self.eager, self.graph, self.dtype, self.tol = eager, graph, dtype, TOL[dtype]
        self.gen = torch.Generator().manual_seed(seed)
        self.n = 0
        self.decode_sizes: list[int] = []
        self.stats = {"steps": 0, "bit_identical_steps": 0, "max_kv_diff": 0.0, "max_logit_diff": 0.0,
                      "near_tie_flips": 0}

    def add(self, n: int, max_tokens: int) -> None:
        for _ in range(n):
            n_ids = int(torch.randint(3, 20, (1,), generator=self.gen))
            ids = torch.randint(1, VOCAB, (n_ids,), generator=self.gen)
            rid = f"r{self.n:04d}"
            self.n += 1
            for rt in (self.eager, self.graph):
                rt.scheduler.add(make_req(rid, ids.tolist(), max_tokens))

    def step(self) -> None:
        be, le = forward(self.eager, DEV)
        bg, lg = forward(self.graph, DEV)
        where = f"step {self.stats['steps']} ({be.mode.value}, bs {len(be.reqs)})"
        assert (be.mode, [r.rid for r in be.reqs]) == (bg.mode, [r.rid for r in bg.reqs]), "schedules differ"
        assert not le.isnan().any() and not lg.isnan().any(), f"NaN logits at {where}"
        torch.testing.assert_close(lg, le, **self.tol, msg=lambda m: f"logits at {where}: {m}")
        same_logits = torch.equal(lg, le)
        assert same_logits or not EXACT, f"logits not bit-identical at {where} (SWASERVE_GPU_EXACT=1)"
        if le.numel():
            self.stats["max_logit_diff"] = max(self.stats["max_logit_diff"], (lg - le).abs().max().item())
        tokens, picked = le.argmax(-1), lg.argmax(-1)
        gap = (le.gather(1, tokens[:, None]) - le.gather(1, picked[:, None])).squeeze(1)
        flips = picked != tokens
        clear = flips & (gap > 2 * self.tol["atol"])  # eager's choice was not a near-tie
        assert not clear.any(), f"greedy tokens differ at {where} (eager's gaps {gap[flips]})"
        self.stats["near_tie_flips"] += int(flips.sum())
        if be.mode.value == "decode":
            self.decode_sizes.append(len(be.reqs))
        toks = tokens.tolist()
        for rt, b in ((self.eager, be), (self.graph, bg)):
            rt.scheduler.process_output(b, toks)
            poison_free_slots(rt)
        same_kv = self._compare_kv(where)
        self.stats["bit_identical_steps"] += same_logits and same_kv
        self.graph.scheduler.check_integrity()
        self.stats["steps"] += 1

    def _compare_kv(self, where: str) -> bool:
        rids_e, kv_e = live_kv(self.eager)
        rids_g, kv_g = live_kv(self.graph)
        assert rids_e == rids_g
        exact = True
        for (name, a, bounds), (_, b, _) in zip(kv_e, kv_g):
            for eng, t in (("eager", a), ("graph", b)):
                bad = t.isnan().flatten(1).any(1).nonzero()
                if bad.numel():
                    row = int(bad[0])
                    rid = rids_e[bisect.bisect_right(bounds, row) - 1]
                    pytest.fail(f"{eng}: live {name} of {rid} holds NaN (a poisoned slot was read or "
                                f"written) at {where}")
            if torch.equal(a, b):
                continue
            exact = False
            diff = (a.float() - b.float()).abs()
            self.stats["max_kv_diff"] = max(self.stats["max_kv_diff"], diff.max().item())
            ok = diff <= self.tol["atol"] + self.tol["rtol"] * a.float().abs()
            if EXACT or not ok.all():
                row = int((~ok if not ok.all() else diff > 0).flatten(1).any(1).nonzero()[0])
                rid = rids_e[bisect.bisect_right(bounds, row) - 1]
                pytest.fail(f"{name} of {rid} differs from eager at {where}: "
                            f"max |diff| {diff.max().item():.3e}"
                            f"{' (SWASERVE_GPU_EXACT=1)' if ok.all() else ''}")
        return exact

    def order(self) -> list[int]:
        s = self.decode_sizes
        return [b for i, b in enumerate(s) if i == 0 or b != s[i - 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shrinking_and_growing_batches_12_9_3_5_12(ckpt, dtype):
    cache = CacheConfig(kv_cache_bytes=4 << 20, swa_evict_margin=0, swa_evict_chunk=1)
    eager, graph = (make_runtime(ckpt, g, dtype, 16, 64, cache) for g in (False, True))
    replays = count_replays(graph)
    run = Lockstep(eager, graph, dtype, seed=0)
    # Decode batch sizes: 12, then 9 (three finish), 3, then 5 and 12 as new requests join.
    for n, max_tokens in ((3, 6), (3, 14), (3, 22), (3, 40)):
        run.add(n, max_tokens)
    for phase in range(80):
        if phase == 30:
            run.add(2, 30)
        if phase == 36:
            run.add(7, 20)
        if not eager.scheduler.has_unfinished():
            break
        run.step()
    assert not eager.scheduler.has_unfinished()
    order = run.order()
    assert order[:2] == [12, 9], order
    i3 = order.index(3)
    assert order[i3 + 1] == 5 and 12 in order[i3 + 2 :], f"batch sizes ran in the order {order}"
    _finish(run, replays, "12-9-3-5-12", dtype)


def test_shrinking_and_growing_batches_256_200_37_256(ckpt):
    dtype = torch.float32
    # SWA pool sized for short requests (the planner's default ratio assumes max-context ones), so
    # nothing is retracted and the batch sizes are exactly the designed ones.
    cache = CacheConfig(kv_cache_bytes=16 << 20, swa_full_tokens_ratio=0.25, swa_evict_margin=0,
                        swa_evict_chunk=1)
    eager, graph = (make_runtime(ckpt, g, dtype, 256, 1024, cache) for g in (False, True))
    replays = count_replays(graph)
    run = Lockstep(eager, graph, dtype, seed=1)
    # 56 finish after 3 decode steps (256 -> 200), 163 after 9 (200 -> 37); 219 join later (-> 256),
    # finish after 7 (-> 37), and the long 37 drain.
    for n, max_tokens in ((56, 4), (163, 10), (37, 40)):
        run.add(n, max_tokens)
    grown = False
    for _ in range(120):
        if not grown and run.decode_sizes[-3:] == [37, 37, 37]:
            run.add(219, 8)
            grown = True
        if not eager.scheduler.has_unfinished():
            break
        run.step()
    assert not eager.scheduler.has_unfinished()
    assert run.order() == [256, 200, 37, 256, 37], run.order()
    _finish(run, replays, "256-200-37-256", dtype)


def _finish(run: Lockstep, replays: list[tuple[int, int]], scenario: str, dtype: torch.dtype) -> None:
    for rt in (run.eager, run.graph):
        assert rt.scheduler.retractions_total == 0, "a retraction changed the designed batch sizes"
    assert [raw for raw, _ in replays] == run.decode_sizes, "a decode step did not replay a CUDA graph"
    padded = sum(raw != bs for raw, bs in replays)
    assert padded > 0
    record({"test": "cuda_graph_padding", "scenario": scenario, "dtype": str(dtype).removeprefix("torch."),
            "decode_steps": len(replays), "padded_replays": padded, "order": run.order(), **run.stats,
            "bit_identical": run.stats["bit_identical_steps"] == run.stats["steps"]})
