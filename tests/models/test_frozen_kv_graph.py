"""The frozen-KV drafter's graph program (`FrozenKVGraphRunner`: the K-step chain over static, padded
buffers; on the CPU run eagerly with the Triton kernels interpreted, on a GPU replayed as CUDA graphs)
against the eager chain: the same drafts for every request while the batch shrinks and grows across
calls (4 -> 3 -> 1 -> 2 -> 3 -> 4 requests, rows in changing orders, so the static buffers hold rows,
lengths and tokens of requests that are gone), padded rows reset to (table row 0, kv_len 1, token 0),
the state row they read (0) never written, and the target's pools untouched: every slot no live
request owns (slot 0 included) is poisoned with NaN and stays NaN, the live K/V stay bit-identical."""

from __future__ import annotations

import pytest
import torch
from families import make_hf_model
from test_frozen_kv_tiny import OPTIONS, hf_drafts, make_assistant, prompts_for

pytest.importorskip("triton")

from swaserve.engine import Engine
from swaserve.request import SamplingParams
from swaserve.speculative.frozen_kv_graph import PAD, FrozenKVGraphRunner

K = 3
CALLS = [[0, 1, 2, 3], [2, 0, 3], [1], [3, 0], [1, 3, 2], [3, 2, 1, 0]]  # indices into the 4 requests


def decoding_engine(tmp_path, device: str, backend: str = "triton"):
    """An mtp Engine (attention `backend`) whose 4 requests all decode, one past 2W + 3 tokens; with the
    HF target and assistant."""
    tdir, adir = tmp_path / "target", tmp_path / "assistant"
    target = make_hf_model("gemma4_ple", tdir)
    assistant = make_assistant(target.config)
    assistant.save_pretrained(adir)
    engine = Engine(str(tdir), device=device, dtype="float32", **OPTIONS, attention_backend=backend,
                    speculative_method="mtp", speculative_draft_model=str(adir), speculative_num_tokens=K)
    prompts = prompts_for(target.config.vocab_size)[:4]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    w = target.config.sliding_window
    for _ in range(40):
        engine.step()
        reqs = [r for r in engine.scheduler.running if r.row is not None and r.kv_len == len(r.ids) - 1]
        if len(reqs) == 4 and max(r.kv_len for r in reqs) > 2 * w + 3:
            break
    assert len(reqs) == 4 and max(r.kv_len for r in reqs) > 2 * w + 3
    return engine, sorted(reqs, key=lambda r: r.rid), target, assistant


def poison_free_slots(rt, reqs) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """NaN into every pool slot the live requests do not own; (buffers, owned masks, owned values)."""
    full = torch.cat([rt.req_to_token.slots(r.row, 0, r.kv_len) for r in reqs]).long()
    rt.allocator.sync_device()
    swa = rt.allocator.full_to_swa_device[full.to(rt.allocator.full_to_swa_device.device)].long()
    owned = {False: full, True: swa[swa > 0]}  # SWA 0: evicted (out of every window)
    bufs, masks, values = [], [], []
    for lid in rt.kv.layer_ids:
        for buf in (rt.kv.k_buffer(lid), rt.kv.v_buffer(lid)):
            keep = torch.zeros(buf.shape[0], dtype=torch.bool, device=buf.device)
            keep[owned[rt.kv.uses_swa_space(lid)].to(buf.device)] = True
            assert not keep[0], "slot 0 is reserved"
            buf[~keep] = float("nan")
            bufs.append(buf)
            masks.append(keep)
            values.append(buf[keep].clone())
    return bufs, masks, values


@torch.no_grad()
def graph_vs_eager(engine, reqs, runner: FrozenKVGraphRunner) -> list[list[list[int]]]:
    """Each call of CALLS through the graph program and eagerly: asserts equal drafts, padded rows
    reset, pools untouched; returns the drafts of every call."""
    rt, drafter = engine._runtime, engine.scheduler.speculation.drafter
    bufs, masks, values = poison_free_slots(rt, reqs)
    table = rt.req_to_token.req_to_token.clone()
    rt.allocator.sync_device()  # the mirror as the next forward sees it (the engine's step may leave it behind)
    mapping = rt.allocator.full_to_swa_device.clone()
    ran, out = [], []
    run = runner.run
    runner.run = lambda rows, kv, tokens: ran.append(len(rows)) or run(rows, kv, tokens)
    for n, call in enumerate(CALLS):
        sub = [reqs[i] for i in call]
        ks = [K - (n + j) % 2 for j in range(len(sub))]  # K and K - 1 drafts
        drafter.graphs = None
        eager = drafter.propose(sub, ks)
        drafter.graphs = runner
        graph = drafter.propose(sub, ks)
        assert [len(d) for d in eager] == ks
        assert graph == eager, f"call {n}: {graph} != {eager}"
        bs = min(b for b in runner.sizes if b >= len(sub))
        assert ran[-1] == len(sub)
        pad = runner.inputs[:, len(sub):bs].cpu()
        assert torch.equal(pad, torch.tensor(PAD)[:, None].expand(-1, bs - len(sub))), f"call {n}: {pad}"
        out.append(graph)
    assert len(ran) == len(CALLS) and any(n not in runner.sizes for n in ran), "no call was padded"
    assert not drafter.states[0].any(), "state row 0 (padded rows) was written"
    for buf, keep, before in zip(bufs, masks, values):
        assert torch.isnan(buf[~keep]).all(), "a free pool slot was written"
        assert torch.equal(buf[keep], before), "a live K/V slot changed"
    assert torch.equal(table, rt.req_to_token.req_to_token)
    assert torch.equal(mapping, rt.allocator.full_to_swa_device)
    return out


def test_padded_program_equals_eager_chain(tmp_path):
    from swaserve.runner.model_runner import create_attention_backend

    # The engine runs on the torch-native backend (interpreted Triton is slow); the drafter, eager
    # and padded alike, on a Triton backend of its own (window W + 1) over the same pools.
    engine, reqs, target, assistant = decoding_engine(tmp_path, "cpu", "torch_native")
    rt, drafter = engine._runtime, engine.scheduler.speculation.drafter
    assert drafter.graphs is None  # CPU: no CUDA graphs
    drafter.backend = create_attention_backend("triton", rt.kv, rt.req_to_token, rt.runner.attn_backend.full_to_swa,
                                               drafter.model.window)
    runner = FrozenKVGraphRunner(drafter, 4, K, capture=False)
    assert runner.sizes == [1, 2, 4]
    drafts = graph_vs_eager(engine, reqs, runner)
    for i, r in enumerate(reqs):  # and the drafts are transformers' (first call: K or K - 1 each)
        assert drafts[0][i] == hf_drafts(target, assistant, r.ids, len(drafts[0][i]))
