"""TritonAttnBackend (kernels in Triton's CPU interpreter) against the torch-native oracle through the
real scheduler: hybrid pools with eviction, chunked prefill crossing the window, batched decode, and
mixed steps (decode rows as one-token extends beside a prefill chunk).
Pins DESIGN.md §5 in CPU CI: every list an SWA-pool layer reads is in SWA space."""

from __future__ import annotations

import pytest
import torch
from families import add_kv_scales, make_hf_model

pytest.importorskip("triton")

from scheduled import Params  # noqa: E402
from scheduled import small_hybrid_runtime as runtime  # noqa: E402

from swaserve.scheduler.req import Req  # noqa: E402


@pytest.mark.parametrize("combine", ["stage2", "fused"])
def test_triton_backend_matches_torch_native(tmp_path, monkeypatch, combine):
    """`fused`: decode splits combined in stage 1 (SWASERVE_FUSED_SPLIT_COMBINE=1)."""
    if combine == "fused":
        monkeypatch.setenv("SWASERVE_FUSED_SPLIT_COMBINE", "1")
    make_hf_model("gemma3", tmp_path, seed=5)
    ref, tri = runtime(tmp_path, "torch_native"), runtime(tmp_path, "triton")
    backend = tri.runner.attn_backend
    assert type(backend).__name__ == "TritonAttnBackend" and tri.kv.swa is not None
    assert (backend._split_counters is not None) == (combine == "fused")
    assert max(backend._num_splits(3, s, w) for s in _specs(tri) for w in (False, True)) > 1, "splits to combine"
    _run_side_by_side(ref, tri)
    if combine == "fused":
        assert not backend._split_counters.any(), "every combining program reset its counter"


@pytest.mark.parametrize("family", ["gemma4", "gemma4_ple", "mimo_v2_flash"])
def test_triton_backend_matches_torch_native_gemma4(tmp_path, family):
    """Different K/V shapes per pool (Gemma 4: SWA 2 x 16, full 1 x 32 with K = V; MiMo-V2: SWA 2 x
    (24 + 16), full 1 x (24 + 16) with sinks on the SWA layers), and KV-shared layers that read their
    source layer's K/V back from the pool (extend gathers them in SWA space)."""
    make_hf_model(family, tmp_path, seed=5)
    ref, tri = runtime(tmp_path, "torch_native"), runtime(tmp_path, "triton")
    assert tri.kv.swa_space and tri.kv.full.k_buffer(0).shape[1:] != tri.kv.swa.k_buffer(0).shape[1:]
    _run_side_by_side(ref, tri)


def test_triton_backend_matches_torch_native_fp8_kv(tmp_path):
    """FP8 KV pools with a checkpoint's per-layer scales (not 1, different per layer): the fused
    norm/rotary/store, the extend kernel reading new tokens back from the pool, and decode, in both
    index spaces, give the oracle's logits (the oracle dequantises what the torch quantiser stored)."""
    make_hf_model("gemma3", tmp_path, seed=5)
    add_kv_scales(tmp_path, {0: (0.5, 2.0), 1: (0.25, 1.5), 2: (2.0, 0.75), 3: (1.0, 4.0)})
    ref, tri = runtime(tmp_path, "torch_native", "fp8_e4m3"), runtime(tmp_path, "triton", "fp8_e4m3")
    assert tri.kv.dtype_of(1) == tri.kv.dtype_of(2) == torch.float8_e4m3fn and tri.kv.swa_space
    assert [float(s) for s in tri.kv.kv_scales(2)] == [2.0, 0.75]
    _run_side_by_side(ref, tri)


def _run_side_by_side(ref, tri) -> None:
    """Both runtimes through the scheduler on the same prompts, the oracle's tokens fed to both:
    logits equal at every step, integrity after every step, every SWA slot recycled and freed."""
    prompts = [list(range(3, 23)), list(range(40, 45)), list(range(60, 73))]  # 20, 5, 13 tokens
    for rt in (ref, tri):
        for i, p in enumerate(prompts):
            rt.scheduler.add(Req(f"r{i}", f"r{i}", 0, len(p), list(p), Params(12), 0, frozenset()))
    modes = set()
    while ref.scheduler.has_unfinished():
        batches = [rt.scheduler.schedule() for rt in (ref, tri)]
        assert [r.rid for r in batches[0].reqs] == [r.rid for r in batches[1].reqs]
        modes.add(batches[0].kind)
        logits = [rt.runner.forward(b.to_forward_batch("cpu", host_decode_inputs=True)) for rt, b in zip((ref, tri), batches)]
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
        idx = batches[0].sample_indices()
        tokens = logits[0][idx].argmax(-1).tolist() if idx else []  # both follow the oracle's tokens
        for rt, b in zip((ref, tri), batches):
            rt.scheduler.process_output(b, tokens)
            rt.scheduler.check_integrity()
    assert modes == {"extend", "mixed", "decode"}
    tri.scheduler.reset_prefix_cache()  # the prefix cache keeps finished prompts until then
    full, swa = tri.allocator.full, tri.allocator.swa
    assert swa.size < full.size and sum(len(p) + 12 for p in prompts) > swa.size, "SWA slots were recycled"
    assert tri.allocator.swa.available() == tri.allocator.swa.size, "every SWA slot freed"


def _specs(rt):
    return [m.spec for m in rt.runner.model.modules() if hasattr(m, "spec")]
