"""Deterministic inference on CPU (tiny random Gemma 3 and Gemma 4 MoE, window 8): probes (greedy and
seeded sampling, prompts longer than the window, chunked) give bitwise the same tokens and logprobs
alone, in shuffled batches with other traffic, at other chunk sizes and under both schedule policies;
with the flag off the same comparison differs, so the mode is what makes them equal."""

from __future__ import annotations

import random

import pytest
import torch
from families import make_hf_model

from swaserve.engine import Engine
from swaserve.loader import LoadedModel
from swaserve.loader.hf_dir import load_model_from_dir
from swaserve.request import SamplingParams

# Probe prompts: 5 tokens (inside the window of 8), 13 and 30 (past it, several chunks), 9.
PROBES = [list(range(3, 8)), list(range(20, 33)), [(7 * i) % 150 + 2 for i in range(30)], list(range(90, 99))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def _sampled(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, ignore_eos=True, logprobs=2, seed=100 + i)


def _engine(path, dtype, deterministic: bool, chunk: int, policy: str = "mixed", kv: str = "auto") -> Engine:
    config, model = load_model_from_dir(path, "cpu", dtype)
    return Engine(LoadedModel(config, model, None, "tiny"), device="cpu", dtype=dtype, kv_cache_bytes=400_000,
                  max_running_requests=8, max_prefill_tokens=chunk, schedule_policy=policy,
                  enable_deterministic_inference=deterministic, disable_prefix_cache=True, kv_cache_dtype=kv)


def _drain(engine: Engine, arrivals: list[tuple[int, str, list[int], SamplingParams]]) -> dict[str, tuple]:
    """Add requests at their steps, run to the end; (tokens, logprobs) per request id."""
    out, step = {}, 0
    while step < 500 and (engine.has_unfinished() or step <= max(a for a, *_ in arrivals)):
        for at, rid, prompt, params in arrivals:
            if at == step:
                engine.add_request(rid, prompt, params)
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (list(c.token_ids), [sorted(d.items()) for d in c.logprobs or []])
        step += 1
    assert not engine.has_unfinished()
    return out


def _probes(sampled: bool) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"p{i}", p, _sampled(i) if sampled else GREEDY) for i, p in enumerate(PROBES)]


def _alone(path, dtype, deterministic: bool, sampled: bool, kv: str = "auto") -> dict[str, tuple]:
    engine = _engine(path, dtype, deterministic, chunk=7, kv=kv)
    res = {}
    for rid, prompt, params in _probes(sampled):
        res.update(_drain(engine, [(0, rid, prompt, params)]))
    return res


def _loaded(path, dtype, deterministic: bool, sampled: bool, chunk: int, policy: str, seed: int,
            kv: str = "auto") -> dict[str, tuple]:
    """The probes among 8 other requests (greedy and sampled, some longer than the window), in a
    shuffled order with staggered arrivals, so they share steps in varying company."""
    rng = random.Random(seed)
    others = [(f"o{j}", [rng.randrange(2, 150) for _ in range(rng.randrange(3, 26))],
               SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(2, 12), ignore_eos=True))
              for j in range(8)]
    reqs = _probes(sampled) + others
    rng.shuffle(reqs)
    arrivals = [(rng.randrange(0, 6), rid, p, sp) for rid, p, sp in reqs]
    res = _drain(_engine(path, dtype, deterministic, chunk, policy, kv), arrivals)
    return {k: v for k, v in res.items() if k.startswith("p")}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    make_hf_model("gemma3", path, seed=5)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_probes_identical_alone_batched_and_rechunked(gemma3_dir, dtype, sampled):
    alone = _alone(gemma3_dir, dtype, True, sampled)
    for chunk, policy, seed in ((5, "mixed", 1), (16, "prefill_first", 2), (11, "mixed", 3)):
        assert _loaded(gemma3_dir, dtype, True, sampled, chunk, policy, seed) == alone, (chunk, policy)


def test_default_path_is_not_batch_invariant(gemma3_dir):
    """The control: without the mode the same probes' logprobs change bitwise with their company
    (CPU GEMMs pick kernels by row count), so the test above would fail with the flag off."""
    alone = _alone(gemma3_dir, torch.float32, False, False)
    loaded = _loaded(gemma3_dir, torch.float32, False, False, 5, "mixed", 1)
    assert loaded != alone


def test_fp8_kv_probes_identical_alone_and_batched(gemma3_dir):
    """An FP8 KV cache keeps the mode's guarantee: quantising on store and dequantising on read are
    elementwise, so the probes' bits still depend on neither their company nor their chunking."""
    alone = _alone(gemma3_dir, torch.float32, True, False, kv="fp8_e4m3")
    assert _loaded(gemma3_dir, torch.float32, True, False, 5, "mixed", 1, kv="fp8_e4m3") == alone


def test_moe_probes_identical_alone_and_batched(tmp_path):
    """Gemma 4 with MoE blocks: an expert's GEMM rows are the tokens routed to it, a batch-dependent
    count; the mode's fixed row blocks make them invariant too."""
    make_hf_model("gemma4_moe", tmp_path, seed=2)
    alone = _alone(tmp_path, torch.bfloat16, True, False)
    assert _loaded(tmp_path, torch.bfloat16, True, False, 6, "mixed", 4) == alone


def test_unseeded_sampled_requests_get_a_reported_seed(gemma3_dir):
    """In the mode a sampled request without a seed gets one at admission, reported on its output;
    resent with that seed, it reproduces its completion. Greedy requests report none."""
    engine = _engine(gemma3_dir, torch.float32, True, chunk=7)
    free = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    first = {}
    engine.add_request("a", PROBES[1], free)
    engine.add_request("g", PROBES[0], GREEDY)
    while engine.has_unfinished():
        first.update({o.request_id: o for o in engine.step() if o.finished})
    seed = first["a"].seed
    assert isinstance(seed, int) and first["g"].seed is None
    again = _drain(engine, [(0, "b", PROBES[1], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True,
                                                                 seed=seed))])
    assert again["b"][0] == list(first["a"].outputs[0].token_ids)


def test_mode_agrees_with_the_default_path(gemma3_dir):
    """Same tokens as the default kernels (fp32), logprobs within float32 reordering noise."""
    mode, default = _alone(gemma3_dir, torch.float32, True, False), _alone(gemma3_dir, torch.float32, False, False)
    for rid in default:
        assert mode[rid][0] == default[rid][0]
        for a, b in zip(mode[rid][1], default[rid][1]):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert torch.allclose(torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]), atol=1e-4)


def test_triton_backend_probes_identical(gemma3_dir, monkeypatch):
    """The unified Triton kernel (CPU interpreter) in the engine: greedy probes alone vs batched, the
    decode steps' sliding layers reading the per-step window slot table; the same tokens as the
    torch-native backend of the mode. Then each decode attention call takes a random program layout
    (per key block, chunk or request) instead of the rule's, and every mixed step runs its decode rows
    as a decode of their own: the same tokens again."""
    pytest.importorskip("triton")
    import swaserve.attention.triton as tb
    import swaserve.kernels.unified_attention as ua
    import swaserve.runner.model_runner as mr
    from swaserve.kernels.index_builders import window_slots

    native = _alone(gemma3_dir, torch.float32, True, False)
    monkeypatch.setattr(mr, "default_attention_backend", lambda device: "triton")
    tables = []
    monkeypatch.setattr(tb, "window_slots", lambda *a: tables.append(a[-1]) or window_slots(*a))
    alone = _alone(gemma3_dir, torch.float32, True, False)
    assert tables and set(tables) == {8}, "decode steps did not build the window slot table"
    assert _loaded(gemma3_dir, torch.float32, True, False, 5, "mixed", 1) == alone
    assert {rid: tokens for rid, (tokens, _) in alone.items()} == {rid: t for rid, (t, _) in native.items()}
    layouts, pick = [], random.Random(0)

    def any_layout(*shapes) -> str:
        layouts.append(pick.choice(ua.PROGRAMS))
        return layouts[-1]

    monkeypatch.setattr(ua, "decode_programs", any_layout)
    monkeypatch.setattr(tb, "num_sms", lambda device: 1)  # any number of decode rows fills "the SMs"
    first_rows, attend = [], tb.unified_attention
    monkeypatch.setattr(tb, "unified_attention",
                        lambda *a, **kw: first_rows.append(kw.get("first_row", 0)) or attend(*a, **kw))
    assert _alone(gemma3_dir, torch.float32, True, False) == alone
    assert _loaded(gemma3_dir, torch.float32, True, False, 5, "mixed", 1) == alone
    assert set(layouts) == set(ua.PROGRAMS), layouts
    assert any(first_rows), "no mixed step ran its decode rows apart"
