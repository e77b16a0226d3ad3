"""Mixed prefill+decode steps against the prefill-first policy on a tiny random Gemma 3 (fp32, greedy):
the same tokens, with and without overlap, on prompts crossing the window, arrivals while others
decode, a small SWA pool that recycles slots, and memory integrity checked after every step."""

from __future__ import annotations

import pytest
import torch
from families import make_hf_model

from swaserve.engine import Engine
from swaserve.loader import LoadedModel
from swaserve.loader.hf_dir import load_model_from_dir
from swaserve.request import SamplingParams

# (arrival step, prompt): 20 and 13 tokens cross the window (W = 8) in chunks of 7; later arrivals
# land while the first ones decode.
ARRIVALS = [(0, list(range(3, 23))), (0, list(range(40, 45))), (3, list(range(60, 73))), (6, [7, 9, 11]),
            (9, list(range(80, 110)))]


def _run(path, policy: str, overlap: bool, backend: str = "torch_native",
         mixed_cap: int | None = None) -> tuple[dict[str, list[int]], set[str]]:
    config, model = load_model_from_dir(path, "cpu", torch.float32)
    engine = Engine(LoadedModel(config, model, None, "tiny"), device="cpu", dtype=torch.float32,
                    kv_cache_bytes=60_000, swa_full_tokens_ratio=0.25, swa_evict_chunk=1,
                    max_running_requests=4, max_prefill_tokens=7, schedule_policy=policy,
                    max_mixed_prefill_tokens=mixed_cap, overlap_schedule=overlap, attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out: dict[str, list[int]] = {}
    kinds: set[str] = set()
    step = 0
    while step < 400 and (engine.has_unfinished() or step <= max(s for s, _ in ARRIVALS)):
        for i, (at, prompt) in enumerate(ARRIVALS):
            if at == step:
                engine.add_request(f"r{i}", prompt, params)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        if engine.last_step is not None:
            kinds.add(engine.last_step[0])
        engine.scheduler.check_integrity()
        step += 1
    assert not engine.has_unfinished()
    engine.scheduler.reset_prefix_cache()  # the prefix cache keeps finished prompts until then
    engine.scheduler.check_integrity()
    alloc = engine.allocator
    assert alloc.full.available() == alloc.full.size and alloc.swa.available() == alloc.swa.size, "all freed"
    assert alloc.swa.size < alloc.full.size, "a small SWA pool: slots were recycled"
    return out, kinds


@pytest.mark.parametrize("overlap,mixed_cap", [(False, None), (True, None), (True, 2)])
def test_mixed_batches_match_prefill_first(tmp_path, overlap, mixed_cap):
    """`mixed_cap`: prefill chunks of at most 2 tokens while anything decodes (more chunk boundaries)."""
    make_hf_model("gemma3", tmp_path, seed=5)
    ref, ref_kinds = _run(tmp_path, "prefill_first", overlap=False)
    got, kinds = _run(tmp_path, "mixed", overlap=overlap, mixed_cap=mixed_cap)
    assert "mixed" in kinds and "mixed" not in ref_kinds
    assert len(ref) == len(ARRIVALS) and all(len(t) == 12 for t in ref.values())
    assert got == ref


def test_mixed_batches_triton_interpreter(tmp_path, monkeypatch):
    """The Triton extend kernel (CPU interpreter) on mixed steps: decode rows as one-token extends."""
    pytest.importorskip("triton")
    make_hf_model("gemma3", tmp_path, seed=5)
    ref, _ = _run(tmp_path, "prefill_first", overlap=False)
    got, kinds = _run(tmp_path, "mixed", overlap=True, backend="triton")
    assert "mixed" in kinds and got == ref
