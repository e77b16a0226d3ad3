"""Tiny random-weight HF models of every supported family: both layer types, windows of 8-12 that
the test prompts cross, and each family's quirks turned up so they matter (small soft-caps, a low
SwiGLU clamp, scaled rotary bases). `gpt_oss_mxfp4` is saved as GPT-OSS is released: MXFP4 experts;
`save_fp8` writes any of them in the block-FP8 layout (DeepSeek-V3 / MiMo-V2-Flash)."""

from __future__ import annotations

import json
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
    # YaRN as GPT-OSS ships it (no truncation), scaled down to this context. A low SwiGLU clamp where
    # transformers reads it from the config; older versions (5.17, the GPU machine's) hard-code 7.0.
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 32}
    limit = 1.0 if "swiglu_limit" in getattr(tf.GptOssConfig, "__dataclass_fields__", {}) else 7.0
    return tf.GptOssConfig(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=8, num_local_experts=4,
                           num_experts_per_tok=2, swiglu_limit=limit, rope_parameters=rope)


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


def gemma3_wide() -> Any:
    """Gemma 3 wide enough that block-FP8 scale grids have several rows and columns and partial blocks:
    hidden 160 (128 + 32), q 160 / k, v 80 each (merged parts that are not whole 128-row blocks),
    intermediate 272 (128 + 128 + 16)."""
    return tf.Gemma3TextConfig(**{**COMMON, "hidden_size": 160, "intermediate_size": 272}, num_hidden_layers=3,
                               head_dim=40, sliding_window=8, query_pre_attn_scalar=24,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])


FAMILIES: dict[str, tuple[Callable[[], Any], type]] = {
    "llama": (llama, tf.LlamaForCausalLM),
    "mistral": (mistral, tf.MistralForCausalLM),
    "qwen3": (qwen3, tf.Qwen3ForCausalLM),
    "gemma2": (gemma2, tf.Gemma2ForCausalLM),
    "gemma3": (gemma3, tf.Gemma3ForCausalLM),
    "gemma3_mqa": (gemma3_mqa, tf.Gemma3ForCausalLM),
    "gpt_oss": (gpt_oss, tf.GptOssForCausalLM),
    "gpt_oss_mxfp4": (gpt_oss, tf.GptOssForCausalLM),  # saved by `save_mxfp4`
    "gemma4": (gemma4, tf.Gemma4ForCausalLM),
    "gemma4_ple": (gemma4_ple, tf.Gemma4ForCausalLM),
    "gemma4_moe": (gemma4_moe, tf.Gemma4ForCausalLM),
    "mimo_v2_flash": (mimo_v2_flash, tf.MiMoV2FlashForCausalLM),
}
# Saved by `save_fp8` (tests/models/test_fp8.py): MiMo-V2-Flash as released (o_proj bf16, experts one by
# one), a wide Gemma 3 with every projection FP8.
FP8_FAMILIES: dict[str, tuple[Callable[[], Any], type]] = {
    "mimo_v2_flash_fp8": (mimo_v2_flash, tf.MiMoV2FlashForCausalLM),
    "gemma3_fp8": (gemma3_wide, tf.Gemma3ForCausalLM),
    "gemma3_wide": (gemma3_wide, tf.Gemma3ForCausalLM),  # unquantised: online FP8
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


# GPT-OSS's published quantization_config (openai/gpt-oss-20b and -120b).
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


@torch.no_grad()
def save_mxfp4(model: torch.nn.Module, out_dir: Path, seed: int, scales: tuple[int, int] = (121, 123)) -> None:
    """Save a GPT-OSS model as the released checkpoints are: every expert weight random MXFP4
    (`*_blocks` uint8 [E, out, in/32, 16], `*_scales` uint8 [E, out, in/32], e8m0 exponents drawn from
    `scales`), the rest as it is, and config.json with the published quantization_config and no
    `swiglu_alpha`. The model's own expert weights become transformers' dequantisation of those bytes
    (`convert_moe_packed_tensors`), so HF runs the very weights the checkpoint holds."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed + 1)
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    for i, layer in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, proj)  # [E, in, out], HF's input-major layout
            E, n_in, n_out = param.shape
            blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8)
            exps = torch.randint(scales[0], scales[1] + 1, (E, n_out, n_in // 32), generator=g, dtype=torch.uint8)
            param.copy_(convert_moe_packed_tensors(blocks, exps, dtype=torch.float32))
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del state[name]
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, exps
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("swiglu_alpha", None)
    config["quantization_config"] = MXFP4_CONFIG
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def make_hf_model(family: str, out_dir: Path, seed: int = 0) -> torch.nn.Module:
    """Build the tiny HF model in fp32 with eager attention, randomise it, save_pretrained to `out_dir`
    (`gpt_oss_mxfp4`: in the released MXFP4 layout, `save_mxfp4`; `*_fp8`: block FP8, `save_fp8`)."""
    make_config, cls = {**FAMILIES, **FP8_FAMILIES}[family]
    config = make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    randomize_(model, seed)
    if family in ("gemma3_fp8", "gemma3_wide"):  # 2.5x wider: smaller weights keep the greedy output varied
        for p in model.parameters():
            if p.ndim >= 2:
                p.data.mul_(0.25)
    if family == "gpt_oss_mxfp4":
        save_mxfp4(model, out_dir, seed)
    elif family.endswith("_fp8"):
        keep = [f"model.layers.{i}.self_attn.o_proj" for i in range(config.num_hidden_layers)] if "mimo" in family else []
        save_fp8(model, out_dir, keep)
    else:
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


# MiMo-V2-Flash's published FP8 settings (attention o_proj kept bf16 in every layer).
def fp8_config(ignored: list[str]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "ignored_layers": ignored}


_FP8_LINEARS = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight", ".gate_proj.weight",
                ".up_proj.weight", ".down_proj.weight")


@torch.no_grad()
def save_fp8(model: torch.nn.Module, out_dir: Path, ignored: list[str]) -> None:
    """Save `model` as a block-FP8 checkpoint: every decoder projection not in `ignored` (HF module
    names) as e4m3 `weight` + float32 `weight_scale_inv` per 128 x 128 block, each checkpoint tensor
    quantised on its own (MiMo's experts one by one, as released); the rest as it is. The model's own
    weights become the dequantised values (fp32), so HF runs the very weights the checkpoint holds."""
    from safetensors.torch import load_file, save_file

    from swaserve.layers import fp8

    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def roundtrip(name: str, w: torch.Tensor) -> None:  # w: a view into the model's parameter
        q, s = fp8.quantize(w)
        w.copy_(fp8.dequantize(q, s, w.dtype))
        quantized[name] = (q, s)

    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if name.endswith(_FP8_LINEARS) and ".layers." in name and module not in ignored:
            roundtrip(name, p.data)
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # stacked: per expert
            inter = p.shape[1] // 2
            for e in range(p.shape[0]):
                if name.endswith("gate_up_proj"):
                    roundtrip(f"{module}.{e}.gate_proj.weight", p.data[e, :inter])
                    roundtrip(f"{module}.{e}.up_proj.weight", p.data[e, inter:])
                else:
                    roundtrip(f"{module}.{e}.down_proj.weight", p.data[e])
    model.save_pretrained(out_dir)
    files = sorted(out_dir.glob("*.safetensors"))
    assert len(files) == 1, files
    state = load_file(str(files[0]))
    for name, (q, s) in quantized.items():
        assert name in state, f"{name} is not a checkpoint tensor"
        state[name] = q
        state[name.replace(".weight", ".weight_scale_inv")] = s
    save_file(state, str(files[0]), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = fp8_config(ignored)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def add_kv_scales(out_dir: Path, scales: dict[int, tuple[float, float]]) -> None:
    """Write static FP8 KV-cache scales into a saved checkpoint as calibration tools store them:
    `model.layers.N.self_attn.k_scale` / `v_scale`, one float32 scalar each (layer N: scales[N])."""
    from safetensors.torch import load_file, save_file

    files = sorted(out_dir.glob("*.safetensors"))
    assert len(files) == 1, files
    state = load_file(str(files[0]))
    for layer, (k, v) in scales.items():
        state[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        state[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    save_file(state, str(files[0]), metadata={"format": "pt"})
