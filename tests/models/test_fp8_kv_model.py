"""An FP8 (e4m3) KV cache on a tiny hybrid Gemma 3 (window 8, sliding and full layers) through the real
scheduler: chunked prefill across the window, SWA eviction, mixed steps. FP8 KV is lossy, so the
comparison with the model-dtype KV run is bounded, not exact: both runtimes are fed the same
(reference) tokens, and every step's logits must stay within a fraction of their spread and pick
the same token. Also: a checkpoint's k_scale / v_scale reach the pools (and are ignored without
FP8), and the planner's pools hold the same tokens in a quarter of fp32's bytes."""

from __future__ import annotations

import pytest
import torch
from families import add_kv_scales, make_hf_model
from scheduled import Params
from scheduled import small_hybrid_runtime as runtime

from swaserve.scheduler.req import Req

# 20, 5, 13 and 30 tokens: inside and past the window of 8, several 7-token chunks.
PROMPTS = [list(range(3, 23)), list(range(40, 45)), list(range(60, 73)), [(7 * i) % 150 + 2 for i in range(30)]]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    make_hf_model("gemma3", path, seed=5)
    return path


def _teacher_forced(ref, other, steps: int = 12) -> tuple[torch.Tensor, int, int]:
    """Both runtimes on PROMPTS, fed the reference's greedy tokens; per sampled row the largest logit
    error over the reference logits' standard deviation, and (agreeing argmax rows, rows)."""
    for rt in (ref, other):
        for i, p in enumerate(PROMPTS):
            rt.scheduler.add(Req(f"r{i}", f"r{i}", 0, len(p), list(p), Params(steps), 0, frozenset()))
    errs, agree, rows = [], 0, 0
    while ref.scheduler.has_unfinished():
        batches = [rt.scheduler.schedule() for rt in (ref, other)]
        assert [r.rid for r in batches[0].reqs] == [r.rid for r in batches[1].reqs], "same pool sizes, same steps"
        logits = [rt.runner.forward(b.to_forward_batch("cpu", host_decode_inputs=True)) for rt, b in zip((ref, other), batches)]
        idx = batches[0].sample_indices()
        tokens = []
        if idx:
            a, b = logits[0][idx], logits[1][idx]
            errs.append((b - a).abs().amax(-1) / a.std(-1))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            rows += len(idx)
            tokens = a.argmax(-1).tolist()
        for rt, b in zip((ref, other), batches):
            rt.scheduler.process_output(b, tokens)
            rt.scheduler.check_integrity()
    other.scheduler.reset_prefix_cache()
    assert other.allocator.swa.available() == other.allocator.swa.size, "every SWA slot freed"
    return torch.cat(errs), agree, rows


def test_fp8_kv_logits_close_to_model_dtype_kv(gemma3_dir):
    """Measured (seed 5): largest error 0.27 of the logits' spread, mean 0.10; 48 of 48 rows pick the
    reference's token (bf16 KV on the same model: 0.012 and 48 of 48). The lower bound on the mean
    error checks the cache really is FP8 (fp32 or bf16 storage stays far below it)."""
    ref, fp8 = runtime(gemma3_dir, "torch_native"), runtime(gemma3_dir, "torch_native", "fp8_e4m3")
    assert (fp8.plan.full_tokens, fp8.plan.swa_tokens) == (ref.plan.full_tokens, ref.plan.swa_tokens)
    assert fp8.plan.total_bytes * 4 <= ref.plan.total_bytes
    err, agree, rows = _teacher_forced(ref, fp8)
    assert rows == len(PROMPTS) * 12
    assert float(err.max()) < 0.5 and 0.03 < float(err.mean()) < 0.2, (float(err.max()), float(err.mean()))
    assert agree >= 0.9 * rows, f"{agree} of {rows} greedy tokens agree"


def test_swa_pool_kept_in_model_dtype(gemma3_dir):
    """`swa_kv_cache_dtype="auto"`: only the full pool is FP8; closer to the reference than all-FP8
    (three of the four layers slide), and the startup line names each pool's dtype."""
    from swaserve.config import CacheConfig, RunnerConfig, SchedulerConfig
    from swaserve.loader.hf_dir import load_model_from_dir
    from swaserve.runtime import build_runtime

    config, model = load_model_from_dir(gemma3_dir, "cpu", torch.float32)
    cache = CacheConfig(kv_cache_bytes=60_000 * 4 // 7, swa_full_tokens_ratio=0.25, swa_evict_margin=0,
                        swa_evict_chunk=1, kv_cache_dtype="fp8_e4m3", swa_kv_cache_dtype="auto")
    mixed = build_runtime(config, model, torch.device("cpu"), torch.float32, cache,
                          SchedulerConfig(max_running_requests=4, max_prefill_tokens=7),
                          RunnerConfig(attention_backend="torch_native"))
    ref = runtime(gemma3_dir, "torch_native")
    assert mixed.kv.full.dtype == torch.float8_e4m3fn and mixed.kv.swa.dtype == torch.float32
    assert (mixed.plan.full_tokens, mixed.plan.swa_tokens) == (ref.plan.full_tokens, ref.plan.swa_tokens)
    line = mixed.plan.describe()
    assert "fp8_e4m3, 64 B/token" in line and "float32, 768 B/token" in line, line
    err, agree, rows = _teacher_forced(ref, mixed)
    assert float(err.max()) < 0.5 and agree >= 0.9 * rows


def test_checkpoint_kv_scales_reach_the_fp8_pools(tmp_path):
    """k_scale / v_scale of each layer land in its pool (SWA layers in the SWA pool, the full layer in
    the full pool); a model-dtype cache ignores them; a scale per head is refused by name."""
    make_hf_model("gemma3", tmp_path, seed=1)
    add_kv_scales(tmp_path, {0: (0.5, 2.0), 2: (3.0, 0.125)})
    fp8 = runtime(tmp_path, "torch_native", "fp8_e4m3")
    assert [float(s) for s in fp8.kv.kv_scales(0)] == [0.5, 2.0]
    assert [float(s) for s in fp8.kv.kv_scales(2)] == [3.0, 0.125] and not fp8.kv.uses_swa_space(2)
    assert [float(s) for s in fp8.kv.kv_scales(1)] == [1.0, 1.0], "layers without scales keep 1.0"
    plain = runtime(tmp_path, "torch_native")
    assert plain.kv.kv_scales(0) is None
    from safetensors.torch import load_file, save_file

    f = next(tmp_path.glob("*.safetensors"))
    state = load_file(str(f))
    state["model.layers.1.self_attn.k_scale"] = torch.ones(2)
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="one KV-cache scale per layer"):
        runtime(tmp_path, "torch_native", "fp8_e4m3")


def test_engine_reports_each_pools_dtype_and_refuses_a_missing_swa_pool(gemma3_dir, tmp_path):
    """`LLM.stats()` / `memory_stats()` carry each pool's bits, `kv_cache_dtypes()` the names, the startup
    line both pools' dtypes; `swa_kv_cache_dtype` on a model without sliding layers is refused by name."""
    from swaserve.engine import Engine
    from swaserve.loader import LoadedModel
    from swaserve.loader.hf_dir import load_model_from_dir

    config, model = load_model_from_dir(gemma3_dir, "cpu", torch.float32)
    engine = Engine(LoadedModel(config, model, None, "tiny"), device="cpu", dtype=torch.float32,
                    kv_cache_bytes=400_000, max_prefill_tokens=16, kv_cache_dtype="fp8_e4m3", swa_kv_cache_dtype="auto")
    stats = engine.counters()
    assert (stats["full_kv_dtype_bits"], stats["swa_kv_dtype_bits"]) == (8, 32)
    assert engine.kv_cache_dtypes() == {"full": "fp8_e4m3", "swa": "float32"}
    line = engine.startup_line()
    assert "fp8_e4m3" in line and "float32" in line, line
    engine.close()
    make_hf_model("llama", tmp_path, seed=0)
    config, model = load_model_from_dir(tmp_path, "cpu", torch.float32)
    with pytest.raises(ValueError, match="no sliding-window pool"):
        Engine(LoadedModel(config, model, None, "tiny"), device="cpu", dtype=torch.float32, kv_cache_bytes=400_000,
               swa_kv_cache_dtype="fp8_e4m3")
