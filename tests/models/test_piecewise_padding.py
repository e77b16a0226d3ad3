"""The piecewise graph's padded program (`PiecewiseGraphRunner`, run eagerly on the CPU: attention
inline at each cut) against the plain eager extend path, through the real scheduler in its mixed
policy: prefill chunks (small budget, so prompts are chunked and cross the window), mixed steps that
carry every running decode plus chunks, batches that shrink and grow so the static buffers hold the
tokens, slots and positions of steps that are gone. Each step: the same hidden states for every
token, the same sampled tokens, the same K/V of every live request in both pools. Free slots and
slot 0 start poisoned (NaN), so a padded token that writes a live slot, or a live token that reads a
padded one, cannot go unnoticed (NaN, or a wrong token: the CPU's GEMMs may round a row 1e-5 apart at
M=24 and at the padded M=32, hence the 1e-4 tolerance). Deterministic mode, whose GEMMs do not depend on M, must give
bit-identical states on every step."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
from families import hf_greedy, make_hf_model
from test_decode_graph_padding import assert_same_live_kv, poison_pools

from swaserve.config import CacheConfig, RunnerConfig, SchedulerConfig
from swaserve.launcher import StepLauncher
from swaserve.loader.hf_dir import load_model_from_dir
from swaserve.request import SamplingParams
from swaserve.runner.extend_graph import ExtendGraphRunner
from swaserve.runner.piecewise_graph import PiecewiseGraphRunner, piecewise_token_sizes
from swaserve.runtime import build_runtime
from swaserve.scheduler.req import Req

BUDGET = 24  # tokens per step: prompts of up to 30 tokens take two chunks


def make_runtime(path, backend: str, padded: bool, deterministic: bool, device: str, dtype: torch.dtype,
                 whole: bool = False, kv_cache_dtype: str = "auto"):
    """`padded`: extend steps through PiecewiseGraphRunner (`whole`: ExtendGraphRunner, one graph a step
    with attention inside; captured on a GPU, the program run eagerly on the CPU); else the plain eager
    extend path."""
    config, model = load_model_from_dir(path, device, dtype)
    cache = CacheConfig(kv_cache_bytes=1 << 20, swa_full_tokens_ratio=0.5, swa_evict_margin=0, swa_evict_chunk=1,
                        disable_prefix_cache=True, kv_cache_dtype=kv_cache_dtype)
    sched = SchedulerConfig(max_running_requests=16, max_prefill_tokens=BUDGET)
    runner = RunnerConfig(attention_backend=backend, disable_cuda_graph=True,
                          enable_deterministic_inference=deterministic)
    rt = build_runtime(config, model, torch.device(device), dtype, cache, sched, runner)
    if padded:  # full steps pad 24 -> 32
        cls = ExtendGraphRunner if whole else PiecewiseGraphRunner
        rt.runner.piecewise = cls(rt.runner, BUDGET + 16, capture=device == "cuda")
    poison_pools(rt)  # everything free (after any capture), slot 0 included
    return rt


WAVES = [(0, 3, 6), (0, 2, 9), (2, 3, 4), (5, 1, 8), (7, 2, 6), (9, 1, 5), (12, 2, 7)]  # (step, requests, max_tokens)
# Four requests (prompts of 7, 28, 26 and 18 tokens) in 10 steps whose padded programs run 24, 12, 24,
# 6 and 21 tokens (padded to 32, 16, 32, 8, 32: the batch shrinks and grows twice), 4 of them mixed:
# for the interpreted Triton backend, whose every step costs seconds.
FEW_WAVES = [(0, 2, 5), (2, 1, 4), (4, 1, 6)]


def run_lockstep(family: str, path, backend: str, deterministic: bool = False, tol: float = 1e-4,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, same_tokens: bool = True,
                 waves: list[tuple[int, int, int]] = WAVES, whole: bool = False, kv_cache_dtype: str = "auto") -> dict:
    """Asserts the rules above (tokens only with `same_tokens`: in bf16 a near-tie may flip between the
    two GEMM shapes, and the run then stops there) and returns counts, with the bit-identical steps."""
    hf = make_hf_model(family, path, seed=3)  # windows of 8-12
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    reqs = []
    for step, n, max_tokens in waves:
        for _ in range(n):
            ids = torch.randint(1, vocab, (int(torch.randint(3, 31, (1,), generator=g)),), generator=g).tolist()
            reqs.append((step, f"r{len(reqs)}", ids, max_tokens))
    first = reqs[0]
    truth = hf_greedy(hf, first[2], first[3])[1]
    eager, padded = (make_runtime(path, backend, p, deterministic, device, dtype, whole, kv_cache_dtype)
                     for p in (False, True))
    launchers = {id(rt): StepLauncher(rt.runner) for rt in (eager, padded)}
    replays: list[int] = []
    replay = padded.runner.piecewise.replay
    padded.runner.piecewise.replay = lambda batch: replays.append(batch.num_tokens) or replay(batch)
    states: dict[int, torch.Tensor] = {}
    for rt in (eager, padded):
        rt.runner.keep_states = True
    added: dict[int, dict[str, Req]] = {id(eager): {}, id(padded): {}}
    steps, bit_identical, mixed, diverged = 0, 0, 0, None
    for phase in range(80):
        for step, rid, ids, max_tokens in reqs:
            if step == phase:
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                for rt in (eager, padded):
                    req = added[id(rt)][rid] = Req(rid, rid, 0, len(ids), list(ids), params, 0, frozenset())
                    rt.scheduler.add(req)
        if not eager.scheduler.has_unfinished():
            break
        seen = []
        for rt in (eager, padded):
            batch = rt.scheduler.schedule()
            tokens, lps = launchers[id(rt)].launch(batch).wait()
            states[id(rt)] = rt.runner.step_states.clone()
            rt.scheduler.process_output(batch, tokens, lps)
            seen.append((batch.mode.value, [r.rid for r in batch.reqs], batch.extend_lens, tokens))
        if seen[0] != seen[1]:
            assert not same_tokens, f"step {phase}: the runtimes diverge"
            diverged = phase
            break
        steps += 1
        mode, _, ext, _ = seen[0]
        mixed += mode == "extend" and 1 in ext and max(ext) > 1
        h_e, h_p = states[id(eager)], states[id(padded)]
        bit_identical += bool(torch.equal(h_e, h_p))
        torch.testing.assert_close(h_p.float(), h_e.float(), rtol=tol, atol=tol)
        assert_same_live_kv(eager, padded, tol, phase)
        padded.scheduler.check_integrity()
    stats = {"family": family, "device": device, "dtype": str(dtype), "backend": backend, "whole": whole,
             "deterministic": deterministic, "steps": steps, "bit_identical_steps": bit_identical,
             "replayed_token_counts": replays, "mixed_steps": mixed, "diverged_at_step": diverged}
    if diverged is not None:
        return stats
    assert not eager.scheduler.has_unfinished()
    sizes = piecewise_token_sizes(BUDGET + 16)
    assert len(replays) >= 3 and any(n not in sizes for n in replays), f"padded token counts {replays}"
    assert mixed > 0, "some step carried decodes and a prefill chunk together"
    for rt in (eager, padded):
        rt.scheduler.check_integrity()
        full = rt.allocator.full if hasattr(rt.allocator, "full") else rt.allocator
        used_swa = rt.allocator.swa_used() if hasattr(rt.allocator, "swa_used") else 0
        assert full.used() == 0 and used_swa == 0, "both pools empty"
    if dtype is torch.float32 and kv_cache_dtype == "auto":  # (bf16 and FP8 K/V part from HF's fp32 run)
        assert added[id(padded)]["r0"].output_ids == truth, "HF's greedy tokens for the first prompt"
    return stats


def test_token_sizes():
    assert piecewise_token_sizes(4096)[:8] == [8, 16, 32, 64, 96, 128, 192, 256]
    assert piecewise_token_sizes(2048)[8:16] == [320, 384, 448, 512, 640, 768, 896, 1024]
    assert piecewise_token_sizes(4096)[-3:] == [3584, 3840, 4096]
    sizes = piecewise_token_sizes(2048)
    for t in range(8, 2049):  # the padding a live step of t tokens pays: < t to 64, then < 1/2, 1/4 past 256,
        n = next(s for s in sizes if s >= t)  # 1/8 past 1024
        assert n - t < (t / 8 if t > 1024 else t / 4 if t > 256 else t / 2 if t > 64 else t), (t, n)
    assert piecewise_token_sizes(100) == [8, 16, 32, 64, 96, 100]
    assert piecewise_token_sizes(5) == [5]


@pytest.mark.parametrize("family", ["gemma3", "mimo_v2_flash", "gemma4_moe", "gpt_oss", "gpt_oss_mxfp4"])
def test_padded_pieces_match_eager(tmp_path, family):
    run_lockstep(family, tmp_path, "torch_native")


def test_padded_pieces_fused_store_match_eager(tmp_path):
    """The Triton backend (interpreted): q/k norm, rotary and the K/V store run fused inside the
    piece over the padded tokens, which must write slot 0 only."""
    pytest.importorskip("triton")
    counts = run_lockstep("gemma3", tmp_path, "triton", waves=FEW_WAVES)["replayed_token_counts"]
    assert len(set(counts)) >= 3 and any(a > b < c for a, b, c in zip(counts, counts[1:], counts[2:])), counts


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_whole_extend_graph_matches_eager(tmp_path, deterministic):
    """ExtendGraphRunner (interpreted Triton): attention inside the step, on static request rows and a
    tile list built from them, padded rows and tokens inert. Deterministic mode: bit for bit, since the
    eager path runs the same unified kernel; default mode against the eager extend kernel (fp32)."""
    pytest.importorskip("triton")
    stats = run_lockstep("gemma3", tmp_path, "triton", deterministic=deterministic, tol=0.0 if deterministic else 1e-4,
                         waves=FEW_WAVES, whole=True)
    if deterministic:
        assert stats["bit_identical_steps"] == stats["steps"], stats


def test_whole_extend_graph_fp8_kv_bit_identical_in_deterministic_mode(tmp_path):
    """The same over FP8 (e4m3) pools: the captured step's decode and extend launches read e4m3 tiles with
    the eager unified kernel's bits."""
    pytest.importorskip("triton")
    stats = run_lockstep("gemma3", tmp_path, "triton", deterministic=True, tol=0.0, waves=FEW_WAVES, whole=True,
                         kv_cache_dtype="fp8_e4m3")
    assert stats["bit_identical_steps"] == stats["steps"], stats


def test_padded_pieces_bit_identical_in_deterministic_mode(tmp_path):
    stats = run_lockstep("gemma3", tmp_path, "torch_native", deterministic=True, tol=0.0)
    assert stats["bit_identical_steps"] == stats["steps"], stats


def test_option_on_cpu(tmp_path):
    """Default: no piecewise graphs on the CPU (nothing to capture); asked for explicitly: a clear error."""
    make_hf_model("gemma3", tmp_path, seed=0)
    config, model = load_model_from_dir(tmp_path, "cpu", torch.float32)
    cache, sched = CacheConfig(kv_cache_bytes=1 << 20), SchedulerConfig(max_prefill_tokens=64, max_context=256)
    rt = build_runtime(config, model, torch.device("cpu"), torch.float32, cache, sched, RunnerConfig())
    assert rt.runner.piecewise is None
    with pytest.raises(ValueError, match="piecewise CUDA graphs need a CUDA device"):
        build_runtime(config, model, torch.device("cpu"), torch.float32, cache, sched,
                      RunnerConfig(enable_piecewise_cuda_graph=True))


@pytest.mark.parametrize("backend,mode,whole", [("triton", "auto", True), ("torch_native", "auto", False),
                                                ("triton", "pieces", False), ("triton", "whole", True)])
def test_extend_graph_option_picks_the_runner(tmp_path, monkeypatch, backend, mode, whole):
    """`--extend-graph auto` (the default): whole graphs where the backend can be captured so (Triton),
    pieces otherwise; `pieces` and `whole` as asked."""
    from swaserve.runner.model_runner import ModelRunner

    if backend == "triton":
        pytest.importorskip("triton")
    calls = []
    monkeypatch.setattr(ModelRunner, "enable_piecewise_graphs", lambda self, n, whole=False: calls.append(whole))
    make_hf_model("gemma3", tmp_path, seed=0)
    config, model = load_model_from_dir(tmp_path, "cpu", torch.float32)
    build_runtime(config, model, torch.device("cpu"), torch.float32, CacheConfig(kv_cache_bytes=1 << 20),
                  SchedulerConfig(max_prefill_tokens=64, max_context=256),
                  RunnerConfig(attention_backend=backend, enable_piecewise_cuda_graph=True, extend_graph=mode))
    assert calls == [whole]


def test_capture_protocol(tmp_path, monkeypatch):
    """The capture sequencing, on the CPU with CUDA's graph API stubbed: per size, after its warm-ups,
    L+1 pieces, each begun and ended once in order (a cut at every attention call between them), all
    in one pool, and the size's output of n rows kept."""
    events: list[str] = []

    class Graph:
        def capture_begin(self, pool=None):
            assert pool == "pool" and (not events or events[-1] in ("end", "run")), events[-3:]
            events.append("begin")

        def capture_end(self):
            assert events[-1] == "begin", events[-3:]
            events.append("end")

        def replay(self):
            events.append("replay")

    class Stream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass

        def synchronize(self):
            events.append("run")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    make_hf_model("gemma3", tmp_path, seed=0)
    config, model = load_model_from_dir(tmp_path, "cpu", torch.float32)
    rt = build_runtime(config, model, torch.device("cpu"), torch.float32, CacheConfig(kv_cache_bytes=1 << 20),
                       SchedulerConfig(max_prefill_tokens=32, max_context=256), RunnerConfig())
    pw = PiecewiseGraphRunner(rt.runner, 32)
    layers = config.hf_config.num_hidden_layers
    assert sorted(pw.graphs) == piecewise_token_sizes(32)
    assert all(len(pw.graphs[n]) == layers + 1 and len(pw.sites[n]) == layers for n in pw.sizes)
    assert events.count("begin") == events.count("end") == len(pw.sizes) * (layers + 1)
    assert all(isinstance(pw.outputs[n][0], torch.Tensor) and pw.outputs[n][0].shape[0] == n for n in pw.sizes)
    if importlib.util.find_spec("triton") is None:
        return
    # Whole extend graphs (interpreted Triton): one graph per size, after its warm-ups.
    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        g.capture_begin(pool="pool")
        yield
        g.capture_end()

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(Graph, "pool", lambda self: "pool", raising=False)
    events.clear()
    rt = build_runtime(config, model, torch.device("cpu"), torch.float32, CacheConfig(kv_cache_bytes=1 << 20),
                       SchedulerConfig(max_prefill_tokens=32, max_context=256, max_running_requests=4),
                       RunnerConfig(attention_backend="triton"))
    whole = ExtendGraphRunner(rt.runner, 32)
    assert sorted(whole.graphs) == piecewise_token_sizes(32)
    assert events == ["run", "begin", "end"] * len(whole.sizes)
    assert all(whole.outputs[n][0].shape[0] == n for n in whole.sizes)
