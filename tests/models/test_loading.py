"""Loading paths and their errors: sharded safetensors, multimodal Gemma 3 and Gemma 4 checkpoints (text part),
bf16 weights, tied heads with a stored copy, and clear errors for missing files, unknown
architectures, unknown/missing weights (GPT-OSS's MXFP4 checkpoints: test_gpt_oss.py)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from families import FAMILIES, gemma3, gemma4, gemma4_ple, make_hf_model, randomize_
from harness import Harness

from swaserve.loader.hf_dir import load_model_from_dir
from swaserve.loader.safetensors import iter_safetensors, safetensors_files
from swaserve.model_config import ModelConfig
from swaserve.models.registry import build_model, get_model_class, supported_architectures

PROMPTS = [list(range(3, 30)), list(range(40, 51))]  # 27 and 11 tokens: both cross W = 8


def prefill_logits(config: ModelConfig, model: torch.nn.Module, dtype=torch.float32) -> torch.Tensor:
    h = Harness(config, model, hybrid=True, full_tokens=128, swa_tokens=64, dtype=dtype)
    return h.extend([h.add_request() for _ in PROMPTS], PROMPTS)


def hf_last_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])


def test_sharded_checkpoint_with_index(tmp_path):
    hf = make_hf_model("gemma3", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(safetensors_files(tmp_path / "sharded")) > 1
    config, model = load_model_from_dir(tmp_path / "sharded", dtype=torch.float32)
    assert (prefill_logits(config, model) - hf_last_logits(hf)).abs().max() < 1e-4


def test_multimodal_gemma3_checkpoint_loads_text_model(tmp_path):
    text = gemma3().to_dict()
    for key in ("architectures", "transformers_version", "model_type", "dtype"):
        text.pop(key, None)
    vision = {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=150, boi_token_index=151, eoi_token_index=152)
    cfg._attn_implementation = "eager"
    hf = tf.Gemma3ForConditionalGeneration(cfg).eval()
    randomize_(hf, 0)
    hf.save_pretrained(tmp_path)
    config, model = load_model_from_dir(tmp_path, dtype=torch.float32)
    assert config.architecture == "Gemma3ForConditionalGeneration" and config.is_hybrid
    assert (prefill_logits(config, model) - hf_last_logits(hf)).abs().max() < 1e-4


def test_multimodal_gemma4_checkpoint_loads_text_model(tmp_path, caplog):
    text = gemma4().to_dict()
    for key in ("architectures", "transformers_version", "model_type", "dtype", "per_layer_config"):
        text.pop(key, None)
    text.update(global_head_dim=32, num_global_key_value_heads=1)
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 8}
    cfg = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    cfg._attn_implementation = "eager"
    hf = tf.Gemma4ForConditionalGeneration(cfg).eval()
    randomize_(hf, 0)
    hf.save_pretrained(tmp_path)
    with caplog.at_level("INFO", logger="swaserve.models.gemma4"):
        config, model = load_model_from_dir(tmp_path, dtype=torch.float32)
    assert "vision/audio towers are skipped" in caplog.text
    assert config.architecture == "Gemma4ForConditionalGeneration"
    assert (config.full_group.k_head_dim, config.swa_group.k_head_dim) == (32, 16)
    assert (prefill_logits(config, model) - hf_last_logits(hf)).abs().max() < 1e-4


def test_kv_shared_layers_skip_stored_kv_weights(tmp_path):
    # Checkpoints may still carry k/v projections for KV-shared layers (HF ignores them on load).
    hf = make_hf_model("gemma4_ple", tmp_path)
    extra = {"model.layers.5.self_attn.k_proj.weight": torch.zeros(64, 64),
             "model.layers.4.self_attn.v_proj.weight": torch.zeros(32, 64)}
    config = ModelConfig.from_hf(gemma4_ple())
    assert config.kv_source == ((4, 3), (5, 1)) and 4 not in config.swa_group.layer_ids
    model = build_model(config, torch.float32, "cpu")
    model.load_weights([*iter_safetensors(tmp_path), *extra.items()])
    assert (prefill_logits(config, model) - hf_last_logits(hf)).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "gpt_oss_mxfp4", "gemma4_moe"])
def test_bf16_weights(tmp_path, family):
    # bf16 end to end (weights, KV pools, activations) vs HF in fp32: a loose check that no
    # path silently mixes dtypes; tight parity is the fp32 tests' job.
    hf = make_hf_model(family, tmp_path)
    config, model = load_model_from_dir(tmp_path, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    ours = prefill_logits(config, model, dtype=torch.bfloat16)
    assert ours.dtype == torch.float32
    ref = hf_last_logits(hf)
    # HF's own bf16 is off by ~0.02 of the scale on dense families; on the tiny MoE (4 experts, top 2)
    # bf16 rounding flips routings and HF's own bf16 is off by ~0.26 of it. Ours may not be worse than
    # twice HF's own bf16 error, nor than 5% of the scale.
    hf_bf16 = hf_last_logits(hf.to(torch.bfloat16))
    own = (hf_bf16 - ref).abs().max()
    assert (ours - ref).abs().max() < max(0.05 * ref.abs().max(), 2 * own), (own, (ours - ref).abs().max())


def test_tied_head_with_stored_copy_is_accepted(tmp_path):
    hf = make_hf_model("gemma2", tmp_path)
    weights = list(iter_safetensors(tmp_path))
    assert not any(n.startswith("lm_head.") for n, _ in weights)
    emb = dict(weights)["model.embed_tokens.weight"]
    config = ModelConfig.from_hf(hf.config)
    model = build_model(config, torch.float32, "cpu")
    model.load_weights(weights + [("lm_head.weight", emb.clone())])
    assert (prefill_logits(config, model) - hf_last_logits(hf)).abs().max() < 1e-4


def test_unknown_and_missing_weights_raise(tmp_path):
    make_hf_model("llama", tmp_path)
    weights = list(iter_safetensors(tmp_path))
    config = ModelConfig.from_hf(tf.AutoConfig.from_pretrained(tmp_path))
    with pytest.raises(ValueError, match="unknown weight 'model.layers.0.self_attn.bogus.weight'"):
        build_model(config, torch.float32, "cpu").load_weights(
            weights + [("model.layers.0.self_attn.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"missing 1 weights.*qkv_proj.weight\[shard 1\]"):
        build_model(config, torch.float32, "cpu").load_weights(
            [(n, t) for n, t in weights if n != "model.layers.1.self_attn.k_proj.weight"])
    with pytest.raises(ValueError, match="missing.*lm_head.weight"):  # untied head must be stored
        build_model(config, torch.float32, "cpu").load_weights([(n, t) for n, t in weights if n != "lm_head.weight"])
    bad = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in weights]
    with pytest.raises(ValueError, match="model.norm.weight.*expected shape"):
        build_model(config, torch.float32, "cpu").load_weights(bad)


def test_missing_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_from_dir(tmp_path)
    tf.LlamaConfig(**{k: v for k, v in FAMILIES["llama"][0]().to_dict().items() if k != "transformers_version"}
                   ).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model_from_dir(tmp_path)


def test_registry():
    assert {"Gemma3ForCausalLM", "Gemma2ForCausalLM", "MistralForCausalLM", "LlamaForCausalLM",
            "Qwen3ForCausalLM", "GptOssForCausalLM", "Gemma4ForCausalLM",
            "Gemma4ForConditionalGeneration"} <= set(supported_architectures())
    with pytest.raises(ValueError, match="unsupported model architecture 'FooForCausalLM'.*LlamaForCausalLM"):
        get_model_class("FooForCausalLM")
    # A config built in code has no `architectures`: the model type decides.
    assert get_model_class("Qwen3Config", "qwen3").__name__ == "Qwen3ForCausalLM"


def test_config_json_is_what_the_loader_reads(tmp_path):
    # Guard the test setup itself: save_pretrained must record the architecture we register.
    make_hf_model("mistral", tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
