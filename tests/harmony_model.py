"""A tiny GPT-OSS checkpoint directory for chat tests: the real o200k_harmony vocabulary (201,088 ids; its
tokenizer.json built from o200k_base.tiktoken, which `scripts/fetch_o200k.sh` fetches) and a config with
hidden size 32, so random weights stay small. Built once per test process."""

from __future__ import annotations

import atexit
import base64
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

VOCAB_SIZE = 201_088
# o200k_base's pre-tokenizer split (tiktoken's published pattern), so the HF tokenizer encodes text as
# harmony does.
O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k_harmony's named special tokens; the other ids from 199998 on are <|reserved_N|>.
SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
            200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
# A harmony-format Jinja template of our own (system, developer instructions, user and final-channel assistant
# turns), standing in for the one GPT-OSS checkpoints ship; it writes <|end|> as theirs does.
TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
    "Current date: {{ strftime_now('%Y-%m-%d') }}\n\nReasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{%- for m in messages %}"
    "{%- if m.role in ('system', 'developer') %}<|start|>developer<|message|># Instructions\n\n{{ m.content }}\n\n<|end|>"
    "{%- elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


def o200k_file() -> Path:
    """o200k_base.tiktoken: in $TIKTOKEN_ENCODINGS_BASE, else where scripts/fetch_o200k.sh puts it."""
    base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    cache = Path(os.environ.get("SWASERVE_CACHE") or Path.home() / ".cache" / "swaserve")
    path = Path(base) / "o200k_base.tiktoken" if base else cache / "o200k" / "o200k_base.tiktoken"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `bash scripts/fetch_o200k.sh` once (CI's .ci/run does)")
    return path


def _read_tiktoken(path: str) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_tokenizer_json(vocab_file: Path, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json as GPT-OSS ships them: byte-level BPE over o200k_base's ranks
    (transformers' tiktoken converter), then o200k_harmony's special tokens at ids 199998..201087."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        load_tiktoken_bpe = staticmethod(_read_tiktoken)  # transformers' own reader needs `tiktoken`

    names = [SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(199_998, VOCAB_SIZE)]
    Converter(str(vocab_file), pattern=O200K_PATTERN, extra_special_tokens=names).converted().save(
        str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
              "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False, "model_max_length": 131072}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def write_config(out_dir: Path) -> None:
    """config.json of a 2-layer GPT-OSS with hidden size 32 (the published rope and layer pattern)."""
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": VOCAB_SIZE,
        "hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8, "num_local_experts": 2, "num_experts_per_tok": 1, "experts_per_token": 1,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "attention_bias": True, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999, "torch_dtype": "float32",
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096},
        "rope_theta": 150000.0,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))


@functools.cache
def gpt_oss_dir() -> Path:
    """The directory (config, tokenizer, generation config, chat template; no weights), built once."""
    root = Path(tempfile.mkdtemp(prefix="swaserve-gpt-oss-"))
    atexit.register(shutil.rmtree, root, True)
    out = root / "gpt-oss-tiny"
    out.mkdir()
    build_tokenizer_json(o200k_file(), out)
    write_config(out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out
