"""MiMo-V2-Flash specifics vs HF transformers on the tiny config of `families.mimo_v2_flash` (fp32, CPU,
window W = 8): every position's logits across the window boundary (W-1, W, W+1, 2W+3) with SWA slots
poisoned as they leave it, prefill chunks that end at W-1 / W / W+1, the grouped sigmoid router and the
partial rotary against HF's own modules, both checkpoint layouts of the experts (per expert as released,
stacked as transformers holds them), MTP weights skipped, and the pools' per-type K/V shapes."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tf
from families import hf_greedy, make_hf_model, mimo_v2_flash
from harness import Harness
from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as hf_mimo

from swaserve.layers.moe import GroupedTopKRouter
from swaserve.layers.rotary import rope_from_config
from swaserve.loader.hf_dir import load_model_from_dir
from swaserve.loader.safetensors import iter_safetensors
from swaserve.model_config import ModelConfig
from swaserve.models.registry import build_model

W = 8
ATOL = 1e-4


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo")
    hf = make_hf_model("mimo_v2_flash", path, seed=3)
    assert hf.config.sliding_window == W
    config, model = load_model_from_dir(path, dtype=torch.float32)
    return path, hf, config, model


def test_pools_take_each_layer_types_kv_shape(mimo):
    _, hf, config, _ = mimo
    c = hf.config
    full, swa = config.full_group, config.swa_group
    assert (full.layer_ids, swa.layer_ids) == ((0, 3), (1, 2))
    assert (full.num_kv_heads, swa.num_kv_heads) == (c.num_key_value_heads, 2 * c.num_key_value_heads)
    assert (full.k_head_dim, full.v_head_dim) == (swa.k_head_dim, swa.v_head_dim) == (c.head_dim, c.v_head_dim)
    for i, layer in enumerate(hf.model.layers):
        attn = layer.self_attn
        group = swa if i in swa.layer_ids else full
        assert attn.k_proj.out_features == group.num_kv_heads * group.k_head_dim
        assert attn.v_proj.out_features == group.num_kv_heads * group.v_head_dim
        assert (attn.sinks is not None) == (i in swa.layer_ids)


def test_every_position_across_the_window(mimo):
    """One token per extend step: each position's logits, W-1 .. 2W+3 included, against HF's forward
    over the whole prompt. The SWA pool holds W + 2 slots, so this decodes only by recycling them."""
    _, hf, config, model = mimo
    prompt = torch.randint(1, hf.config.vocab_size, (2 * W + 4,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    h = Harness(config, model, hybrid=True, full_tokens=len(prompt) + 2, swa_tokens=W + 2)
    row = h.add_request()
    ours = torch.cat([h.extend([row], [[t]]) for t in prompt])
    h.release(row)
    h.assert_empty()
    diff = (ours - ref).abs().amax(-1)
    for p in (W - 2, W - 1, W, W + 1, 2 * W + 3):
        assert diff[p] < ATOL, f"position {p}: max |logit diff| {diff[p]:.2e}"
    assert diff.max() < ATOL


STEPS = 6


@pytest.fixture(scope="module")
def boundary_prompts(mimo):
    """Prompts of 2W+3, W+1 and W-2 tokens with HF `generate`'s logits and tokens for each."""
    hf = mimo[1]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in (2 * W + 3, W + 1, W - 2)]
    return prompts, [hf_greedy(hf, p, STEPS) for p in prompts]


@pytest.mark.parametrize("chunk", [W - 1, W, W + 1])
def test_prefill_chunks_ending_at_the_window_boundary(mimo, boundary_prompts, chunk):
    """Chunked prefill whose chunk edges fall at W-1, W or W+1, then batched decodes stepping over the
    same positions for the shortest prompt: logits and greedy tokens as HF `generate`."""
    _, _, config, model = mimo
    prompts, refs = boundary_prompts
    h = Harness(config, model, hybrid=True, full_tokens=sum(len(p) + STEPS for p in prompts) + 4,
                swa_tokens=3 * (W + 2))
    logits, tokens = h.generate(prompts, STEPS, chunk=chunk)
    h.assert_empty()
    for p, lg, toks, (ref_logits, ref_tokens) in zip(prompts, logits, tokens, refs):
        assert toks == ref_tokens, f"prompt of {len(p)}: tokens differ from HF"
        assert (lg - ref_logits).abs().max() < ATOL


@pytest.mark.parametrize(
    "n_group,topk_group,top_k,norm,scale",
    [(4, 2, 2, True, 2.5), (1, 1, 3, False, 1.0), (8, 3, 4, True, 1.0), (2, 1, 2, False, 0.7)],
)
def test_router_matches_hf(n_group, topk_group, top_k, norm, scale):
    cfg = tf.MiMoV2FlashConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=top_k, n_group=n_group,
                               topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    g = torch.Generator().manual_seed(n_group * 10 + top_k)
    ref = hf_mimo.MiMoV2FlashTopkRouter(cfg)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 32, generator=g) * 0.3)
        ref.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.2)
    ours = GroupedTopKRouter(32, 16, top_k, n_group, topk_group, norm, scale)
    ours.load_state_dict({"weight": ref.weight, "e_score_correction_bias": ref.e_score_correction_bias})
    x = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        _, ref_w, ref_ids = ref(x)
        w, ids = ours(x)
    # HF picks unsorted: compare (expert, weight) sets per token.
    ref_sorted, order = ref_ids.sort(-1)
    got_sorted, got_order = ids.sort(-1)
    assert torch.equal(got_sorted, ref_sorted)
    torch.testing.assert_close(w.gather(1, got_order), ref_w.gather(1, order), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("head_dim", [24, 192])
@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_partial_rotary_matches_hf(head_dim, layer_type):
    cfg = tf.MiMoV2FlashConfig(head_dim=head_dim, layer_types=["full_attention", "sliding_attention"],
                               num_hidden_layers=2)
    hf_rope = hf_mimo.MiMoV2FlashRotaryEmbedding(cfg)
    ours = rope_from_config(cfg, head_dim, layer_type, default_partial=0.334)
    assert ours.rotary_dim == 2 * (int(head_dim * 0.334) // 2) < head_dim
    pos = torch.tensor([0, 1, 7, 8, 9, 131, 4099])
    q = torch.randn(len(pos), 4, head_dim)
    k = torch.randn(len(pos), 2, head_dim)
    cos, sin = hf_rope(q, pos[None], layer_type)
    ref_q, ref_k = hf_mimo.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(pos, q, k)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert torch.equal(got_q[..., ours.rotary_dim:], q[..., ours.rotary_dim:])


def test_stacked_and_per_expert_checkpoints_load_the_same(mimo):
    """The saved directory holds experts one by one (as released); transformers' state_dict holds
    them stacked (what the GPU parity tests load). MTP weights are skipped without a word."""
    path, hf, config, per_expert = mimo
    names = [n for n, _ in iter_safetensors(path)]
    assert any(".mlp.experts.0.gate_proj." in n for n in names) and any("attention_sink_bias" in n for n in names)
    state = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state and "model.layers.1.self_attn.sinks" in state
    stacked = build_model(config, torch.float32, "cpu")
    stacked.load_weights(state.items())
    for (name, a), (_, b) in zip(per_expert.named_parameters(), stacked.named_parameters()):
        assert torch.equal(a, b), name


def test_mtp_weights_are_skipped_quietly(mimo, caplog):
    path, _, config, _ = mimo
    model = build_model(config, torch.float32, "cpu")
    mtp = {"model.mtp.layers.0.enorm.weight": torch.ones(64), "model.mtp.layers.0.eh_proj.weight": torch.ones(64, 128)}
    with caplog.at_level(logging.INFO):
        model.load_weights([*iter_safetensors(path), *mtp.items()])
    assert not caplog.records


def test_missing_expert_is_an_error(mimo):
    path, _, config, _ = mimo
    model = build_model(config, torch.float32, "cpu")
    weights = [(n, t) for n, t in iter_safetensors(path) if n != "model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 expert weights of model\.layers\.2\.mlp\.experts.*\(5, 'up_proj'\)"):
        model.load_weights(weights)


def test_router_stays_float32_in_bf16_models():
    model = build_model(ModelConfig.from_hf(mimo_v2_flash()), torch.bfloat16, "cpu")
    routers = [m for m in model.modules() if isinstance(m, GroupedTopKRouter)]
    assert len(routers) == 3 and all(p.dtype == torch.float32 for r in routers for p in r.parameters())
    assert model.lm_head.weight.dtype == torch.bfloat16
