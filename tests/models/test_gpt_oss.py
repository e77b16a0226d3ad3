"""GPT-OSS as released: the published config.json (no `swiglu_alpha`, MXFP4 `quantization_config`) builds
with 4-bit experts in the bytes the checkpoint stores; a tiny checkpoint written in the published MXFP4
layout is exactly what transformers reads from it; no dequantised copy stays resident; mismatched or
unsupported formats are clear errors; dummy loads draw MXFP4; tensor parallelism splits the experts on
32-input groups, unevenly where it must (the greedy-parity runs: test_models_vs_hf.py, family
`gpt_oss_mxfp4`; TP=2: test_tensor_parallel.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from families import MXFP4_CONFIG, gpt_oss, make_hf_model
from harness import Harness

from swaserve.distributed.state import TPGroup, set_tp_group
from swaserve.layers import gpt_oss_experts as experts_mod
from swaserve.layers import mxfp4
from swaserve.layers.gpt_oss_experts import GptOssExperts, expert_shard
from swaserve.loader import load_model
from swaserve.loader.hf_dir import load_hf_config, load_model_from_dir
from swaserve.loader.safetensors import iter_safetensors
from swaserve.model_config import ModelConfig
from swaserve.models.gpt_oss import swiglu_params
from swaserve.models.registry import build_model

GIB = 1 << 30


def published_config(layers: int, experts: int) -> dict:
    """openai/gpt-oss-20b's config.json (24 layers, 32 experts) as published; -120b's differs only in
    its 36 layers and 128 experts. No `swiglu_alpha`: the model's 1.702 is a constant of its code."""
    return {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
        "num_local_experts": experts, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": MXFP4_CONFIG, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
    }


@pytest.mark.parametrize(("layers", "experts", "gib"), [(24, 32, 12.8), (36, 128, 60.8)], ids=["20b", "120b"])
def test_published_config_builds_with_4bit_experts(tmp_path, layers, experts, gib):
    (tmp_path / "config.json").write_text(json.dumps(published_config(layers, experts)))
    hf = load_hf_config(tmp_path)
    config = ModelConfig.from_hf(hf)
    assert config.sliding_window == 128 and config.is_sliding(0) and not config.is_sliding(1)
    model = build_model(config, torch.bfloat16, "meta")
    H, I, E = 2880, 2880, experts
    packed = E * (2 * I * H + H * I)  # inputs of every expert weight
    nbytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    expert_bytes = sum(b for n, b in nbytes.items() if ".experts." in n and not n.endswith("_bias"))
    assert expert_bytes == layers * (packed // 2 + packed // 32)  # 4 bits a weight + a byte per 32
    for name, p in model.named_parameters():
        want = torch.uint8 if name.endswith(("_blocks", "_scales")) else None
        assert p.dtype == want if want else p.dtype in (torch.bfloat16, torch.float32), (name, p.dtype)
    exp = model.model.layers[0].mlp.experts
    assert exp.quantized and (exp.alpha, exp.limit) == (1.702, 7.0)
    assert tuple(exp.gate_up_proj_blocks.shape) == (E, 2 * I, H // 32, 16)
    assert tuple(exp.down_proj_scales.shape) == (E, H, I // 32)
    assert sum(nbytes.values()) / GIB == pytest.approx(gib, abs=0.05)  # what the weights take on the GPU


def test_swiglu_constants_do_not_come_from_a_library_default():
    # transformers 5.17 (the GPU machine's) has neither field; 5.24 defaults both. Ours: the config's values
    # where present, else the released model's constants.
    assert swiglu_params(SimpleNamespace()) == (1.702, 7.0)
    assert swiglu_params(SimpleNamespace(swiglu_limit=5.0)) == (1.702, 5.0)
    assert swiglu_params(SimpleNamespace(swiglu_alpha=None, swiglu_limit=None)) == (1.702, 7.0)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return path, make_hf_model("gpt_oss_mxfp4", path)


def test_checkpoint_layout_is_what_transformers_reads_and_stays_4bit(mxfp4_dir):
    path, hf = mxfp4_dir
    written = json.loads((path / "config.json").read_text())
    assert "swiglu_alpha" not in written and written["quantization_config"]["quant_method"] == "mxfp4"
    # transformers' own MXFP4 loader (dequantising on the CPU) reads the experts we wrote as the
    # model we compare against holds them.
    theirs = tf.GptOssForCausalLM.from_pretrained(path, quantization_config=tf.Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32).state_dict()
    for name, t in hf.state_dict().items():
        assert torch.equal(theirs[name].float(), t), name
    _, model = load_model_from_dir(path, dtype=torch.bfloat16)
    float_expert = [n for n, p in [*model.named_parameters(), *model.named_buffers()]
                    if ".experts." in n and not n.endswith("_bias") and p.dtype != torch.uint8]
    assert not float_expert, f"dequantised expert weights resident: {float_expert}"
    stored = dict(iter_safetensors(path))
    for i, layer in enumerate(model.model.layers):
        exp = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            ours = mxfp4.dequantize(getattr(exp, f"{proj}_blocks"), getattr(exp, f"{proj}_scales"), torch.float32)
            ref = getattr(hf.model.layers[i].mlp.experts, proj).transpose(1, 2)  # [E, out, in]
            if proj == "gate_up_proj":  # ours: gate rows, then up rows; HF: interleaved pairs
                ref = torch.cat([ref[:, 0::2], ref[:, 1::2]], dim=1)
            assert torch.equal(ours, ref), (i, proj)
            for part in ("blocks", "scales"):  # the stored bytes, rows reordered only
                raw = stored[f"model.layers.{i}.mlp.experts.{proj}_{part}"]
                if proj == "gate_up_proj":
                    raw = torch.cat([raw[:, 0::2], raw[:, 1::2]], dim=1)
                assert torch.equal(getattr(exp, f"{proj}_{part}"), raw), (i, proj, part)


def test_formats_that_do_not_match_or_are_unsupported_are_clear_errors(mxfp4_dir, tmp_path):
    path, _ = mxfp4_dir
    cfg = gpt_oss()
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="quant_method 'fp8' is not supported"):
        build_model(ModelConfig.from_hf(cfg), torch.float32, "cpu")
    dense = build_model(ModelConfig.from_hf(gpt_oss()), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"stores MXFP4 experts .*_proj_blocks.* makes them dense"):
        dense.load_weights(iter_safetensors(path))
    make_hf_model("gpt_oss", tmp_path)
    packed = build_model(ModelConfig.from_hf(load_hf_config(path)), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"stores dense experts .* makes them MXFP4"):
        packed.load_weights(iter_safetensors(tmp_path))


def test_modules_to_not_convert_keeps_experts_dense():
    cfg = gpt_oss()
    cfg.quantization_config = {**MXFP4_CONFIG, "modules_to_not_convert": ["model.layers.1.mlp", "lm_head"]}
    model = build_model(ModelConfig.from_hf(cfg), torch.float32, "meta")
    assert [layer.mlp.experts.quantized for layer in model.model.layers] == [True, False, True, True]


def test_dummy_load_draws_mxfp4_experts(tmp_path):
    cfg = gpt_oss()
    cfg.architectures = ["GptOssForCausalLM"]
    cfg.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "quantization_config": MXFP4_CONFIG}))
    loaded = load_model(str(tmp_path), torch.device("cpu"), torch.float32, load_format="dummy")
    exp = loaded.model.model.layers[0].mlp.experts
    assert exp.quantized and exp.gate_up_proj_blocks.dtype == torch.uint8
    w = mxfp4.dequantize(exp.gate_up_proj_blocks, exp.gate_up_proj_scales, torch.float32)
    assert 0.012 < w.pow(2).mean().sqrt() < 0.03  # like the N(0, 0.02) of dense dummy weights
    assert set(exp.down_proj_scales.unique().tolist()) == set(mxfp4.DUMMY_SCALES)
    h = Harness(loaded.config, loaded.model, hybrid=True, full_tokens=96, swa_tokens=64)
    _, tokens = h.generate([list(range(5, 25)), list(range(30, 41))], 6)
    assert all(len(t) == 6 for t in tokens)
    h.assert_empty()


def test_expert_shards_follow_32_input_groups():
    assert [expert_shard(2880, 32, r, 2) for r in range(2)] == [(0, 1440), (1440, 1440)]
    assert [expert_shard(2880, 32, r, 4) for r in range(4)] == [(0, 736), (736, 736), (1472, 704), (2176, 704)]
    assert [expert_shard(2880, 1, r, 4) for r in range(4)] == [(0, 720), (720, 720), (1440, 720), (2160, 720)]
    with pytest.raises(ValueError, match="tensor_parallel_size 4 exceeds the 3 groups of 32"):
        expert_shard(96, 32, 0, 4)


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "mxfp4"])
def test_uneven_expert_shards_sum_to_the_whole(quantized, monkeypatch):
    """TP=4 over an intermediate of 224 (7 groups of 32: shares 64, 64, 64, 32), ranks run in one process:
    the ranks' partial outputs (the all-reduce's inputs) sum to the unsplit experts' output."""
    E, H, I, n = 4, 64, 224, 6
    g = torch.Generator().manual_seed(0)
    if quantized:
        hf = {"gate_up_proj_blocks": torch.randint(0, 256, (E, 2 * I, H // 32, 16), generator=g, dtype=torch.uint8),
              "gate_up_proj_scales": torch.randint(121, 124, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8),
              "down_proj_blocks": torch.randint(0, 256, (E, H, I // 32, 16), generator=g, dtype=torch.uint8),
              "down_proj_scales": torch.randint(121, 124, (E, H, I // 32), generator=g, dtype=torch.uint8)}
    else:
        hf = {"gate_up_proj": 0.1 * torch.randn(E, H, 2 * I, generator=g),
              "down_proj": 0.1 * torch.randn(E, I, H, generator=g)}
    hf |= {"gate_up_proj_bias": torch.randn(E, 2 * I, generator=g), "down_proj_bias": torch.randn(E, H, generator=g)}
    x = torch.randn(n, H, generator=g)
    weights = torch.softmax(torch.randn(n, 2, generator=g), -1)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(n)])

    def run(rank: int, size: int) -> torch.Tensor:
        set_tp_group(TPGroup(rank, size))
        try:
            m = GptOssExperts(E, H, I, 1.702, 2.0, quantized)
            for name, p in m.named_parameters():
                p.data.copy_(m.tp_slice(name, hf[name]))
        finally:
            set_tp_group(TPGroup())
        return m(x, weights, ids)

    monkeypatch.setattr(experts_mod, "all_reduce", lambda t: t)
    whole = run(0, 1)
    parts = [run(r, 4) for r in range(4)]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_router_is_float32_in_bf16_models():
    """A bf16 model routes as float32 arithmetic does on the same inputs (bf16 logits would reorder
    close experts: 10 tokens of these 4096)."""
    model = build_model(ModelConfig.from_hf(gpt_oss()), torch.bfloat16, "cpu")
    routers = [layer.mlp.router for layer in model.model.layers]
    assert all(p.dtype == torch.float32 for r in routers for p in r.parameters())
    assert model.lm_head.weight.dtype == torch.bfloat16
    router = routers[0]
    g = torch.Generator().manual_seed(0)
    router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    router.bias.copy_(torch.randn(router.bias.shape, generator=g))
    x = torch.randn(4096, router.weight.shape[1], generator=g).bfloat16()
    weights, ids = router(x)
    exact = torch.addmm(router.bias.double(), x.double(), router.weight.double().T)
    top, exact_ids = exact.topk(router.top_k, dim=-1)
    assert weights.dtype == torch.float32 and torch.equal(ids, exact_ids)
    torch.testing.assert_close(weights.double(), torch.softmax(top, -1), rtol=1e-5, atol=1e-6)
