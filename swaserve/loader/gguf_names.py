"""Per-architecture GGUF conventions: GGUF -> HF tensor names, llama.cpp's stored-weight tweaks, and
GGUF metadata -> transformers config. Facts checked against llama.cpp's convert_hf_to_gguf.py.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")

# GGUF stem (after "blk.N.") -> HF module path (after "model.layers.N.").
_ATTN = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# NOTE: in llama-style blocks GGUF's "ffn_norm" is HF's *post_attention_layernorm* (the pre-MLP norm).
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}

_LAYER_MAPS: dict[str, dict[str, str]] = {
    "gemma3": {**_ATTN, **_QK_NORM, **_GEMMA_NORMS},
    "gemma2": {**_ATTN, **_GEMMA_NORMS},
    "llama": {**_ATTN, **_LLAMA_NORMS},
    "qwen2": {**_ATTN, **_LLAMA_NORMS},
    "qwen3": {**_ATTN, **_QK_NORM, **_LLAMA_NORMS},
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_HF_ARCH = {
    "gemma3": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(_LAYER_MAPS)
# Families swaserve runs from HF directories whose GGUF form it does not read (yet), with why.
_HF_DIR_ONLY = {
    "gemma4": "Gemma 4 is not supported for GGUF (its per-layer head shapes, KV-shared layers, per-layer "
              "embeddings and experts have no mapping here); load the HF model directory instead",
}


def tensor_name_map(arch: str) -> dict[str, str]:
    """The per-layer stem map of `arch`; `ValueError` naming the supported ones if unknown."""
    if arch in _HF_DIR_ONLY:
        raise ValueError(_HF_DIR_ONLY[arch])
    if arch not in _LAYER_MAPS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _LAYER_MAPS[arch]


def hf_tensor_name(gguf_name: str, layer_map: dict[str, str]) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if HF has no such tensor."""
    m = _LAYER.match(gguf_name)
    if m:
        hf = layer_map.get(m.group(2))
        return None if hf is None else f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    stem, _, suffix = gguf_name.rpartition(".")
    hf = _GLOBAL.get(stem)
    return None if hf is None else f"{hf}.{suffix}"


def fix_tensor(arch: str, gguf_name: str, t: torch.Tensor, config: Any) -> torch.Tensor:
    """Undo what llama.cpp's converter did to a float32 tensor on its way into the file."""
    if arch.startswith("gemma") and gguf_name.endswith("norm.weight"):
        # HF Gemma RMSNorm computes x * (1 + w); llama.cpp stores (1 + w) and multiplies by it.
        return t - 1
    if arch == "llama" and re.search(r"\.attn_[qk]\.(weight|bias)$", gguf_name):
        # llama.cpp interleaves the two rotary halves of each head's rows (its rope is GPT-J style).
        heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
        half = t.shape[0] // heads // 2
        return t.reshape(heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
    return t


# --- metadata -> config ---------------------------------------------------------------------------


def _f32(x: Any) -> float:
    # GGUF floats are float32; the shortest repr gives back the config's decimal (1e-06, not 9.99e-07).
    return float(str(np.float32(x)))


def _per_layer(value: Any, name: str) -> int:
    # Some files store a per-layer array (e.g. head_count_kv); one value across layers is all we support.
    if isinstance(value, np.ndarray):
        if value.size == 0 or (value != value.flat[0]).any():
            raise ValueError(f"GGUF {name} varies across layers ({value.tolist()}); not supported")
        return int(value.flat[0])
    return int(value)


def _layer_types(meta: dict[str, Any], arch: str, n_layers: int, default_period: int) -> list[str]:
    """Sliding vs full per layer. llama.cpp: with period p, layer i is full iff i % p == p - 1."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", default_period)
    if isinstance(pattern, np.ndarray):  # per-layer booleans, True = sliding
        if pattern.size != n_layers:
            raise ValueError(f"sliding_window_pattern has {pattern.size} entries for {n_layers} layers")
        return ["sliding_attention" if s else "full_attention" for s in pattern.tolist()]
    p = int(pattern)
    return ["sliding_attention" if p == 0 or i % p < p - 1 else "full_attention" for i in range(n_layers)]


def _rope(meta: dict[str, Any], arch: str, default_theta: float) -> dict[str, Any]:
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", default_theta)),
    }
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"GGUF rope scaling {kind!r} is not supported (only linear)")
        rope.update(rope_type="linear", factor=_f32(meta[f"{arch}.rope.scaling.factor"]))
    return rope


def build_config(arch: str, meta: dict[str, Any], tensor_names: list[str]) -> Any:
    """A transformers config for `arch` from GGUF metadata (only text-decoder fields matter)."""
    import transformers

    tensor_name_map(arch)  # raises for unknown architectures
    if arch == "llama" and "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style rope scaling is baked into a frequency tensor whose HF parameters
        # (factor, low/high freq factors) the file does not carry; loading it as plain rope is wrong.
        raise ValueError(
            "GGUF llama file with rope_freqs (llama3 rope scaling) is not supported; use the HF checkpoint"
        )

    def g(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden, n_layers, n_heads = (
        int(g("embedding_length")),
        int(g("block_count")),
        int(g("attention.head_count")),
    )
    head_dim = int(g("attention.key_length", hidden // n_heads))
    vocab = g("vocab_size", meta.get("tokenizer.ggml.tokens"))
    if vocab is None:
        raise ValueError("GGUF file has neither a vocab_size nor a tokenizer vocabulary")

    def tok(key: str) -> Any:
        return meta.get(f"tokenizer.ggml.{key}")

    kw: dict[str, Any] = {
        "architectures": [_HF_ARCH[arch]],
        "vocab_size": int(vocab) if not isinstance(vocab, list) else len(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": _per_layer(g("attention.head_count_kv", n_heads), "head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(g("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    # Special ids the file does not state keep the config class's defaults (as transformers does).
    for hf_key, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if (value := tok(key)) is not None:
            kw[hf_key] = int(value)
    if arch.startswith("gemma"):
        # llama.cpp scales queries by 1/sqrt(hidden/heads) for the 27B models (Gemma 2: 46 layers,
        # Gemma 3: 62) and by 1/sqrt(head_dim) otherwise; HF calls the denominator query_pre_attn_scalar.
        is_27b = n_layers == (62 if arch == "gemma3" else 46)
        kw.update(
            query_pre_attn_scalar=hidden // n_heads if is_27b else head_dim,
            sliding_window=int(g("attention.sliding_window")),
        )
    if arch == "gemma3":
        # Gemma 3 has no soft-capping (llama.cpp's converter asserts it), whatever the keys say.
        kw["layer_types"] = _layer_types(meta, arch, n_layers, default_period=6)
        local = {"rope_type": "default", "rope_theta": _f32(g("rope.freq_base_swa", 10_000.0))}
        kw["rope_parameters"] = {"full_attention": _rope(meta, arch, 1_000_000.0), "sliding_attention": local}
        return transformers.Gemma3TextConfig(**kw)
    if arch == "gemma2":
        kw["layer_types"] = _layer_types(meta, arch, n_layers, default_period=2)
        kw["rope_parameters"] = _rope(meta, arch, 10_000.0)
        # Missing keys keep HF's defaults (attention 50, final 30), which are llama.cpp's defaults too.
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if (value := g(key)) is not None:
                kw[key] = _f32(value)
        return transformers.Gemma2Config(**kw)
    kw["rope_parameters"] = _rope(meta, arch, 10_000.0 if arch == "llama" else 1_000_000.0)
    if arch == "llama":
        return transformers.LlamaConfig(**kw)
    if arch == "qwen2":
        kw.pop("head_dim")  # Qwen2 derives it; its attention has q/k/v biases (present as tensors)
        return transformers.Qwen2Config(**kw)
    return transformers.Qwen3Config(**kw)
