"""EAGLE-3 heads with random weights on tiny targets: every proposal equals a plain-torch reference of
the head (fed the target's layer states from HF transformers), prefix-cache hits included; greedy
tokens identical to plain decoding (batched, prompts crossing the windows, prefill chunked); a draft
vocabulary smaller than the target's mapped through d2t; pools (target and head) empty at the end."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from families import make_hf_model
from safetensors.torch import save_file
from scheduled import greedy_tokens, spy_with_truth

from swaserve.engine import Engine

OPTIONS = {"max_prefill_tokens": 16, "max_running_requests": 4, "max_context": 160, "kv_cache_bytes": 4 << 20}
# Per target family: the head's hidden size (64 = the target's), draft vocabulary, whether it ships its
# own embedding, and the target layers it reads (layer-output ids; None: the default 2, L // 2, L - 3).
HEADS = {"llama": (64, 100, False, [0, 1, 0]), "gemma3": (48, 160, True, None)}


def make_head(out, target_vocab: int, target_hidden: int, hidden: int, draft_vocab: int, embed: bool,
              layer_ids: list[int] | None, seed: int = 1) -> dict[str, torch.Tensor]:
    """An HF-format EAGLE-3 head directory (config.json + model.safetensors, the published names)."""
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}} if layer_ids else {}
    cfg = tf.LlamaConfig(vocab_size=target_vocab, hidden_size=hidden, intermediate_size=80, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_hidden_layers=1, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                         target_hidden_size=target_hidden, **extra)
    cfg.save_pretrained(out)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.15):
        return scale * torch.randn(*shape, generator=g)

    H, kv = hidden, 2 * 16
    w = {"fc.weight": rnd(H, 3 * target_hidden), "midlayer.input_layernorm.weight": 1 + rnd(H),
         "midlayer.hidden_norm.weight": 1 + rnd(H), "midlayer.post_attention_layernorm.weight": 1 + rnd(H),
         "midlayer.self_attn.q_proj.weight": rnd(64, 2 * H), "midlayer.self_attn.k_proj.weight": rnd(kv, 2 * H),
         "midlayer.self_attn.v_proj.weight": rnd(kv, 2 * H), "midlayer.self_attn.o_proj.weight": rnd(H, 64),
         "midlayer.mlp.gate_proj.weight": rnd(80, H), "midlayer.mlp.up_proj.weight": rnd(80, H),
         "midlayer.mlp.down_proj.weight": rnd(H, 80), "norm.weight": 1 + rnd(H), "lm_head.weight": rnd(draft_vocab, H)}
    if embed:
        w["embed_tokens.weight"] = rnd(target_vocab, H, scale=1.0)
    if draft_vocab < target_vocab:  # the draft vocabulary: a random subset of the target's, in order
        hot = torch.randperm(target_vocab, generator=g)[:draft_vocab].sort().values
        w["d2t"] = hot - torch.arange(draft_vocab)
        w["t2d"] = torch.zeros(target_vocab, dtype=torch.bool).index_fill_(0, hot, True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    return w


# -- a plain-torch reference of the head --------------------------------------------------------------

def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):  # x [n, heads, d]; HF's rotate-half form
    d = x.shape[-1]
    f = pos[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = torch.cat([f.cos(), f.cos()], -1)[:, None].float(), torch.cat([f.sin(), f.sin()], -1)[:, None].float()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def reference_drafts(w, embed, aux, next_ids, base: int, k: int) -> list[int]:
    """Entries at positions base.. from (aux[j], embed[next_ids[j]]); then k - 1 chained steps on the
    head's own pre-norm output."""
    keys, vals = [], []

    def layer(e, g, pos):  # e, g [n, H] -> pre-norm out [n, H]; K/V appended, causal over all entries
        x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"]), _rms(g, w["midlayer.hidden_norm.weight"])], -1)
        a = "midlayer.self_attn."
        q = _rope((x @ w[a + "q_proj.weight"].T).view(len(x), 4, 16), pos)
        keys.append(_rope((x @ w[a + "k_proj.weight"].T).view(len(x), 2, 16), pos).repeat_interleave(2, 1))
        vals.append((x @ w[a + "v_proj.weight"].T).view(len(x), 2, 16).repeat_interleave(2, 1))
        K, V = torch.cat(keys), torch.cat(vals)
        s = torch.einsum("qhd,khd->hqk", q, K) / 4.0
        n0 = len(K) - len(x)
        s = s.masked_fill(torch.arange(len(K))[None, :] > (n0 + torch.arange(len(x)))[:, None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), V).reshape(len(x), 64) @ w[a + "o_proj.weight"].T
        h = o + g
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T))
        return mlp @ w["midlayer.mlp.down_proj.weight"].T + h

    def token(out):
        d = int((_rms(out, w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
        return d + int(w["d2t"][d]) if "d2t" in w else d

    n = len(next_ids)
    out = layer(embed[next_ids], aux @ w["fc.weight"].T, torch.arange(base, base + n))[-1:]
    drafts = [token(out)]
    for s in range(1, k):
        out = layer(embed[drafts[-1:]], out, torch.tensor([base + n - 1 + s]))
        drafts.append(token(out))
    return drafts


def target_states(hf, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The residual stream entering each of `layers` (the layer count: the input of the final norm),
    from HF transformers; `[len(ids), 3 * hidden]`."""
    seen = {}
    stack = hf.model
    mods = [*stack.layers, stack.norm]
    hooks = [mods[i].register_forward_pre_hook(
        lambda m, a, kw, i=i: seen.__setitem__(i, a[0] if a else kw["hidden_states"]), with_kwargs=True)
        for i in set(layers)]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.cat([seen[i][0] for i in layers], -1)


def plain_tokens(path, prompts, steps, device="cpu", tp: int = 1):
    engine = Engine(str(path), device=device, dtype="float32", **OPTIONS, tensor_parallel_size=tp)
    try:
        return greedy_tokens(engine, prompts, steps, engine.check_integrity)
    finally:
        engine.close()


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(1, vocab, (7,), generator=g).tolist()
    return [motif * 5, torch.randint(1, vocab, (30,), generator=g).tolist(), motif[:3] * 4]


def eagle3_run(family: str, tmp_path, device: str = "cpu", tp: int = 1) -> tuple[int, int]:
    """Plain vs eagle3 greedy on `device` (fp32), two rounds (the second hits the prefix cache), lossless
    and every pool empty after; the number of the head's proposals equal to the reference, and of all.
    `tp`: the eagle3 engine's tensor-parallel size (the plain one's too)."""
    target_dir, head_dir = tmp_path / "target", tmp_path / "head"
    hf = make_hf_model(family, target_dir)
    V, Ht = hf.config.vocab_size, hf.config.hidden_size
    hidden, draft_vocab, own_embed, layer_ids = HEADS[family]
    w = make_head(head_dir, V, Ht, hidden, draft_vocab, own_embed, layer_ids)
    prompts = prompts_for(V)
    plain = plain_tokens(target_dir, prompts, 20, device, tp)

    engine = Engine(str(target_dir), device=device, dtype="float32", **OPTIONS, speculative_method="eagle3",
                    speculative_draft_model=str(head_dir), speculative_num_tokens=3, tensor_parallel_size=tp)
    try:
        return _eagle3_checks(engine, hf, w, family, prompts, plain, device)
    finally:
        engine.close()


def _eagle3_checks(engine, hf, w, family, prompts, plain, device) -> tuple[int, int]:
    V, Ht = hf.config.vocab_size, hf.config.hidden_size
    hidden, draft_vocab, own_embed, layer_ids = HEADS[family]
    drafter = engine.scheduler.speculation.drafter
    if device == "cuda":  # the head's chained decode steps and catch-up extends replay CUDA graphs
        assert drafter.rt.runner.graph_runner is not None and drafter.rt.runner.verify_graphs is not None
    records = spy_with_truth(drafter, plain)

    def check():
        engine.check_integrity()
        drafter.cache.check_integrity()

    for _ in range(2):  # the second round reads its prompts' prefixes from the prefix cache
        assert greedy_tokens(engine, prompts, 20, check) == plain
    assert not drafter.seqs and not drafter.cache.rows, "the drafter forgets finished sequences"
    stats = engine.memory_stats()
    assert stats["full_tokens_used"] == 0 and stats["swa_tokens_used"] == 0
    c = engine.counters()
    assert c["spec_draft_tokens_total"] == sum(len(d) for _, _, d in records) > 60
    assert c["spec_accepted_tokens_total"] > 60  # the true tokens handed in (and any the head got right)

    embed = w["embed_tokens.weight"] if own_embed else hf.model.embed_tokens.weight.detach()
    if own_embed:
        assert hidden != Ht  # the head's width differs from the target's: fc projects 3 x 64 to 48
    layers = drafter.layers
    assert layers == (tuple(i + 1 for i in layer_ids) if layer_ids else (2, 2, 1))
    agree = 0
    for ids, base, drafts in records:
        aux = target_states(hf, ids[:-1], layers)[base:]
        ref = reference_drafts(w, embed, aux, ids[base + 1:], base, len(drafts))
        agree += ref == drafts
    if family == "llama":  # a full-attention target: the second round hits the prefix cache
        assert any(base > 0 for _, base, _ in records)
        hot = set((torch.arange(draft_vocab) + w["d2t"]).tolist())
        assert all(set(ds) <= hot for _, _, ds in records)  # drafts are target ids of the draft vocabulary
    return agree, len(records)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eagle3_drafts_match_reference_and_are_lossless(family, tmp_path):
    agree, total = eagle3_run(family, tmp_path)
    assert agree == total, f"{agree}/{total} proposals equal the reference"


def test_eagle3_refuses_mismatched_heads(tmp_path):
    target_dir = tmp_path / "target"
    make_hf_model("llama", target_dir)
    wide = tmp_path / "wide"
    make_head(wide, 160, 96, 64, 160, True, [0, 1, 0])
    with pytest.raises(ValueError, match="hidden size 96"):
        Engine(str(target_dir), device="cpu", dtype="float32", **OPTIONS, speculative_method="eagle3",
               speculative_draft_model=str(wide))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        Engine(str(target_dir), device="cpu", dtype="float32", **OPTIONS, speculative_method="eagle3",
               speculative_draft_model=str(target_dir))
    cfg = json.loads((wide / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
