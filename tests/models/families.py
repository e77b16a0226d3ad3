"""Tiny random-weight HF models of every supported family: both layer types, windows of 8-12 that
the test prompts cross, and each family's quirks turned up so they matter (small soft-caps, a low
SwiGLU clamp, scaled rotary bases)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers as tf

COMMON = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "eos_token_id": None, "pad_token_id": 0}


def llama() -> Any:
    # llama3 frequency scaling with a short original context so all three bands occur.
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return tf.LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters=rope, tie_word_embeddings=False,
                          attention_bias=True, mlp_bias=True)


def mistral() -> Any:
    return tf.MistralConfig(**COMMON, num_hidden_layers=3, sliding_window=8, head_dim=24, tie_word_embeddings=False)


def qwen3() -> Any:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    return tf.Qwen3Config(**COMMON, num_hidden_layers=4, head_dim=16, use_sliding_window=True, sliding_window=12,
                          max_window_layers=2, rope_parameters=rope, tie_word_embeddings=True)


def gemma2() -> Any:
    return tf.Gemma2Config(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                           attn_logit_softcapping=4.0, final_logit_softcapping=3.0,
                           hidden_activation="gelu_pytorch_tanh")


def gemma3() -> Any:
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
    return tf.Gemma3TextConfig(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                            "sliding_attention"], rope_parameters=rope)


def gemma3_mqa() -> Any:
    """One K/V head (Gemma-3-1B's form: tensor-parallel ranks each keep a copy) and a vocabulary that
    two ranks cannot split evenly."""
    return tf.Gemma3TextConfig(**{**COMMON, "num_key_value_heads": 1, "vocab_size": 163}, num_hidden_layers=3,
                               head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def gpt_oss() -> Any:
    # YaRN as GPT-OSS ships it (no truncation), scaled down to this context.
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 32}
    return tf.GptOssConfig(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=8, num_local_experts=4,
                           num_experts_per_tok=2, swiglu_limit=1.0, rope_parameters=rope)


def _gemma4(**kw: Any) -> Any:
    # Full layers twice as wide as sliding ones (Gemma 4's 512 vs 256), proportional RoPE on them.
    return tf.Gemma4TextConfig(**COMMON, head_dim=16, global_head_dim=32, sliding_window=8,
                               final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", **kw)


def gemma4() -> Any:
    """Dense, K = V on the full layers, which also have fewer K/V heads (the 31B / 26B attention)."""
    return _gemma4(num_hidden_layers=4, attention_k_eq_v=True, num_global_key_value_heads=1,
                   hidden_size_per_layer_input=0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"])


def gemma4_ple() -> Any:
    """Per-layer embeddings, the last two layers KV-shared (one of each type) with double-wide MLPs (E2B/E4B)."""
    return _gemma4(num_hidden_layers=6, hidden_size_per_layer_input=8, vocab_size_per_layer_input=160,
                   num_kv_shared_layers=2, use_double_wide_mlp=True,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                "sliding_attention", "full_attention"])


def gemma4_moe() -> Any:
    """The 26B-A4B form: a routed-experts block beside every dense MLP, K = V full layers."""
    return _gemma4(num_hidden_layers=4, attention_k_eq_v=True, num_global_key_value_heads=1,
                   hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=24,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])


def mimo_v2_flash() -> Any:
    """Q/K heads of 24 and V heads of 16 (the real 192 / 128), sliding layers with twice the full
    layers' K/V heads and sinks, a third of each head rotated with a θ per layer type, V scaled, a
    dense first layer then 8 experts in 4 groups (top 2 of 2 groups), scaled, renormalised routing."""
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
    return tf.MiMoV2FlashConfig(**{**COMMON, "num_key_value_heads": 1}, num_hidden_layers=4, head_dim=24,
                                v_head_dim=16, sliding_window=8, attention_value_scale=0.6, rope_parameters=rope,
                                layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                             "full_attention"],
                                n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                moe_intermediate_size=24, routed_scaling_factor=2.5, norm_topk_prob=True)


FAMILIES: dict[str, tuple[Callable[[], Any], type]] = {
    "llama": (llama, tf.LlamaForCausalLM),
    "mistral": (mistral, tf.MistralForCausalLM),
    "qwen3": (qwen3, tf.Qwen3ForCausalLM),
    "gemma2": (gemma2, tf.Gemma2ForCausalLM),
    "gemma3": (gemma3, tf.Gemma3ForCausalLM),
    "gemma3_mqa": (gemma3_mqa, tf.Gemma3ForCausalLM),
    "gpt_oss": (gpt_oss, tf.GptOssForCausalLM),
    "gemma4": (gemma4, tf.Gemma4ForCausalLM),
    "gemma4_ple": (gemma4_ple, tf.Gemma4ForCausalLM),
    "gemma4_moe": (gemma4_moe, tf.Gemma4ForCausalLM),
    "mimo_v2_flash": (mimo_v2_flash, tf.MiMoV2FlashForCausalLM),
}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights big enough that every path matters: norms jitter around their identity, biases and
    sinks are far from zero (routing and sinks then vary per token)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if "norm" in name:
            p.add_(0.2 * noise)
        elif p.ndim >= 2:
            p.copy_(0.12 * noise)
        else:
            p.copy_(0.5 * noise)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale: a buffer, 1 at init
            b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):  # MiMo-V2's routing bias: a buffer, 0 at init
            b.copy_(0.2 * torch.randn(b.shape, generator=g))


def make_hf_model(family: str, out_dir: Path, seed: int = 0) -> torch.nn.Module:
    """Build the tiny HF model in fp32 with eager attention, randomise it, save_pretrained to `out_dir`."""
    make_config, cls = FAMILIES[family]
    config = make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    randomize_(model, seed)
    model.save_pretrained(out_dir)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """HF `generate` (greedy, no EOS stop) on one prompt alone: per-step logits `[steps, vocab]`, tokens."""
    ids = torch.tensor([prompt])
    gen = tf.GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    tokens = out.sequences[0, len(prompt):].tolist()
    return torch.cat(out.logits).float(), tokens
