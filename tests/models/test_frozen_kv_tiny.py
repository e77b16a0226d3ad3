"""The frozen-KV MTP drafter (Gemma 4's assistant) on tiny random models: every draft it proposes inside a
real Engine run equals what transformers' `Gemma4AssistantForCausalLM` drafts from the same target state
(target hidden state and K/V of positions [0, len(ids) - 1)), batched, prompts crossing the window,
prefill chunked, a prefix-cache hit; greedy output identical to plain decoding and to HF's assisted
generation; drafting never writes the target's pools; clear errors for checkpoints that do not fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from families import _gemma4, make_hf_model, randomize_
from scheduled import greedy_tokens

from swaserve.engine import Engine

# Eviction at once (chunk 1) from a margin of 0, which the drafter must raise to keep its W + 1 keys.
OPTIONS = {"max_prefill_tokens": 16, "max_running_requests": 4, "max_context": 160, "kv_cache_bytes": 4 << 20,
           "swa_evict_chunk": 1, "swa_evict_margin": 0}


def make_assistant(tcfg, hidden: int = 48, ordered: bool = False, seed: int = 1):
    """A random 2-layer (sliding, full) assistant whose K/V shapes fit the target config `tcfg`."""
    kw = {"attention_k_eq_v": True, "num_global_key_value_heads": 1} if tcfg.attention_k_eq_v else {}
    text = _gemma4(num_hidden_layers=2, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                   layer_types=["sliding_attention", "full_attention"], **kw).to_dict()
    text.update(hidden_size=hidden, intermediate_size=80)
    cfg = tf.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=tcfg.hidden_size, num_centroids=16,
                                   use_ordered_embeddings=ordered, centroid_intermediate_top_k=4)
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.Gemma4AssistantForCausalLM(cfg).float().eval()
    randomize_(model, seed)
    if ordered:
        perm = torch.randperm(tcfg.vocab_size, generator=torch.Generator().manual_seed(seed))
        model.masked_embedding.token_ordering.copy_(perm)
    model.generation_config.num_assistant_tokens = 3
    return model


@torch.no_grad()
def make_copying(target: torch.nn.Module, assistant: torch.nn.Module, damp: float = 0.3) -> None:
    """Damp both models' layer outputs so the target mostly repeats its last token and the assistant
    (its input half = that token's target embedding, its LM head = the target's embedding) drafts it:
    drafts are accepted often but not always."""
    for name, p in target.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight", "per_layer_projection.weight")):
            p.mul_(damp)
    for name, p in assistant.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            p.mul_(damp)
    h = assistant.config.text_config.hidden_size
    assistant.pre_projection.weight[:, :h].copy_(torch.eye(h))
    assistant.pre_projection.weight[:, h:].mul_(damp)
    assistant.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)


@torch.no_grad()
def hf_drafts(target, assistant, ids: list[int], k: int) -> list[int]:
    """HF's assistant loop (`SinglePositionMultiTokenCandidateGenerator`) from the target's state after
    `ids[:-1]`: its last hidden state and its shared K/V of exactly those positions."""
    out = target(torch.tensor([ids[:-1]]), output_hidden_states=True, return_shared_kv_states=True)
    hidden, kv = out.hidden_states[-1][:, -1:], out.shared_kv_states
    token, pos = torch.tensor([[ids[-1]]]), torch.tensor([[len(ids) - 1]])
    drafts = []
    for _ in range(k):
        o = assistant(inputs_embeds=torch.cat([target.get_input_embeddings()(token), hidden], dim=-1),
                      position_ids=pos, shared_kv_states=kv, use_cache=False)
        token, hidden = o.logits.argmax(dim=-1), o.last_hidden_state
        drafts.append(int(token))
    return drafts


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    p = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (5, 13, 30, 21)]
    return p + [list(p[2])]  # waits for a row, then hits the prefix cache on all but its last token


def run(path: str, prompts: list[list[int]], steps: int, device: str = "cpu",
        **spec) -> tuple[dict[str, list[int]], Engine, list]:
    """Greedy outputs, the engine, and every (ids, k, drafts) the drafter proposed."""
    engine = Engine(path, device=device, dtype="float32", **OPTIONS, **spec)
    proposed: list[tuple[list[int], int, list[int]]] = []
    if spec:
        drafter = engine.scheduler.speculation.drafter
        propose = drafter.propose

        def recording(reqs, ks):
            out = propose(reqs, ks)
            proposed.extend((list(r.ids), k, d) for r, k, d in zip(reqs, ks, out))
            return out

        drafter.propose = recording
    out = greedy_tokens(engine, prompts, steps, engine.check_integrity)
    stats = engine.memory_stats()
    assert stats["full_tokens_used"] == 0 and stats["swa_tokens_used"] == 0
    return out, engine, proposed


def mtp_run(family: str, copying: bool, ordered: bool, tmp_path, device: str = "cpu") -> tuple[int, int, dict]:
    """Plain and mtp greedy runs of 5 prompts (one a prefix-cache hit) on `device`: asserts they agree
    and that nearly every request due a draft got one; returns how many proposals equal HF's drafts,
    out of how many, and the engine counters."""
    tdir, adir = tmp_path / "target", tmp_path / "assistant"
    target = make_hf_model(family, tdir)
    assistant = make_assistant(target.config, hidden=64 if copying else 48, ordered=ordered)
    if copying:
        make_copying(target, assistant)
        target.save_pretrained(tdir)
    assistant.save_pretrained(adir)
    prompts = prompts_for(target.config.vocab_size)
    plain, _, _ = run(str(tdir), prompts, 20, device)
    spec, engine, proposed = run(str(tdir), prompts, 20, device, speculative_method="mtp",
                                 speculative_draft_model=str(adir), speculative_num_tokens=3)
    assert spec == plain
    drafted = [(ids, d) for ids, k, d in proposed if d]
    assert len(drafted) >= 0.9 * len([k for _, k, _ in proposed if k]), "requests went undrafted"
    assert max(len(ids) for ids, _ in drafted) > 2 * target.config.sliding_window + 3
    agree = sum(d == hf_drafts(target, assistant, ids, len(d)) for ids, d in drafted)
    return agree, len(drafted), engine.counters()


@pytest.mark.parametrize("family,copying,ordered", [("gemma4_ple", False, False), ("gemma4_ple", True, False),
                                                    ("gemma4", True, True)])
def test_drafts_equal_hf_and_greedy_is_lossless(family, copying, ordered, tmp_path):
    agree, total, c = mtp_run(family, copying, ordered, tmp_path)
    assert agree == total
    assert c["spec_draft_tokens_total"] > 0
    if copying:
        assert 0 < c["spec_accepted_tokens_total"] < c["spec_draft_tokens_total"]


def test_assisted_generation_matches_hf(tmp_path):
    """HF's own assisted generation (its tokens equal plain greedy, so this checks the wiring end to end)."""
    tdir, adir = tmp_path / "target", tmp_path / "assistant"
    target = make_hf_model("gemma4_ple", tdir)
    assistant = make_assistant(target.config, hidden=64)
    make_copying(target, assistant)
    target.save_pretrained(tdir)
    assistant.save_pretrained(adir)
    prompt = prompts_for(target.config.vocab_size)[2]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             assistant_model=assistant, eos_token_id=None, pad_token_id=0)
    out, engine, _ = run(str(tdir), [prompt], 20, speculative_method="mtp", speculative_draft_model=str(adir))
    assert out["0"] == hf[0, len(prompt):].tolist()
    assert engine.counters()["spec_accepted_tokens_total"] > 0


@torch.no_grad()
def test_drafting_never_writes_the_target_pools(tmp_path):
    tdir, adir = tmp_path / "target", tmp_path / "assistant"
    target = make_hf_model("gemma4_ple", tdir)
    assistant = make_assistant(target.config)
    assistant.save_pretrained(adir)
    engine = Engine(str(tdir), device="cpu", dtype="float32", **OPTIONS, speculative_method="mtp",
                    speculative_draft_model=str(adir))
    from swaserve.request import SamplingParams

    for i, p in enumerate(prompts_for(target.config.vocab_size)[:4]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    w = target.config.sliding_window
    for _ in range(40):  # until all four decode, one of them past 2W + 3
        engine.step()
        reqs = [r for r in engine.scheduler.running if r.row is not None and r.kv_len == len(r.ids) - 1]
        if len(reqs) == 4 and max(r.kv_len for r in reqs) > 2 * w + 3:
            break
    assert len(reqs) == 4 and max(r.kv_len for r in reqs) > 2 * w + 3
    rt, drafter = engine._runtime, engine.scheduler.speculation.drafter
    full = torch.cat([rt.req_to_token.slots(r.row, 0, r.kv_len) for r in reqs])
    owned = {False: full, True: rt.allocator.full_to_swa[full]}
    pools = []
    for lid in rt.kv.layer_ids:
        for buf in (rt.kv.k_buffer(lid), rt.kv.v_buffer(lid)):
            # Poison every slot the live requests do not own (slot 0 included) with a value no layer
            # writes: a draft that read one, or a write anywhere, shows.
            keep = torch.zeros(buf.shape[0], dtype=torch.bool)
            keep[owned[rt.kv.uses_swa_space(lid)]] = True
            buf[~keep] = 1e4
            pools.append(buf)
    before = [b.clone() for b in pools]
    table = rt.req_to_token.req_to_token.clone()
    rt.allocator.sync_device()  # the mirror as the next forward sees it (the engine's step may leave it behind)
    mapping = rt.allocator.full_to_swa_device.clone()
    drafts = drafter.propose(reqs, [3] * len(reqs))
    assert all(len(d) == 3 for d in drafts)
    for r, d in zip(reqs, drafts):
        assert d == hf_drafts(target, assistant, r.ids, 3)
    for b, a in zip(before, pools):
        assert torch.equal(b, a)
    assert torch.equal(table, rt.req_to_token.req_to_token)
    assert torch.equal(mapping, rt.allocator.full_to_swa_device)
    # The oldest key of a sliding layer lost its SWA slot (as after a prefix-cache hit whose window
    # starts at a tombstone): that request is not drafted for, the others are as before.
    r = max(reqs, key=lambda r: r.kv_len)
    rt.allocator.free_swa(rt.req_to_token.slots(r.row, r.kv_len - w - 1, r.kv_len - w))
    again = drafter.propose(reqs, [3] * len(reqs))
    assert again == [[] if q is r else d for q, d in zip(reqs, drafts)]


def test_bad_checkpoints_are_refused(tmp_path):
    tdir, adir, g3 = tmp_path / "target", tmp_path / "assistant", tmp_path / "gemma3"
    target = make_hf_model("gemma4_ple", tdir)
    make_assistant(target.config).save_pretrained(adir)
    make_hf_model("gemma3", g3)
    with pytest.raises(ValueError, match="gemma4_assistant"):
        Engine(str(tdir), device="cpu", dtype="float32", **OPTIONS, speculative_method="mtp",
               speculative_draft_model=str(g3))
    with pytest.raises(ValueError, match="speculative_draft_model"):
        Engine(str(tdir), device="cpu", dtype="float32", **OPTIONS, speculative_method="mtp")
    with pytest.raises(ValueError, match="Gemma 4 target"):
        Engine(str(g3), device="cpu", dtype="float32", **OPTIONS, speculative_method="mtp",
               speculative_draft_model=str(adir))
    wide = tmp_path / "wide"
    narrow = SimpleNamespace(hidden_size=32, vocab_size=160, attention_k_eq_v=False)
    make_assistant(narrow).save_pretrained(wide)  # an assistant trained for a narrower target
    with pytest.raises(ValueError, match="hidden size 32"):
        Engine(str(tdir), device="cpu", dtype="float32", **OPTIONS, speculative_method="mtp",
               speculative_draft_model=str(wide))
