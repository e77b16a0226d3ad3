"""Tokenizer: the embedded Gemma 3 GGUF tokenizer against transformers' GGUF tokenizer and an
independent llama.cpp-style SentencePiece oracle; chat templates, stop ids, caching, bad input."""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import swaserve.loader.tokenizer_files as tokenizer_files
from swaserve.loader.gguf import read_gguf_header
from swaserve.tokenizer import GEMMA_CHAT_TEMPLATE, Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces",
    "multiple    spaces   and\ttabs\n\nnewlines\n",
    "emoji 😀 and a family 👩‍👩‍👧‍👦, flags 🇯🇵",
    "東京は日本の首都です。 中文 한국어",
    "naïve café — “quotes” ½ ﬁ",
    "def f(x):\n    return x**2\n",
    "",
    " ",
]


@pytest.fixture(scope="module")
def embedded_gguf() -> Path:
    from swaserve.loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def cache() -> Iterator[Path]:
    # Removed afterwards (pytest's tmp dirs linger), since it holds a 33 MB tokenizer.json.
    with tempfile.TemporaryDirectory(prefix="swaserve-cache-") as d, pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWASERVE_CACHE", d)
        yield Path(d)


@pytest.fixture(scope="module")
def tok(embedded_gguf: Path, cache: Path) -> Tokenizer:
    return Tokenizer.from_gguf(embedded_gguf)  # cold: converts into the (empty) module cache


@pytest.fixture(scope="module")
def ref(embedded_gguf: Path) -> PreTrainedTokenizerFast:
    # What AutoTokenizer.from_pretrained(dir, gguf_file=...) builds for a gemma3 file, minus its
    # 11 s GGUFReader pass that only picks the class.
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    return GemmaTokenizer.from_pretrained(str(embedded_gguf.parent), gguf_file=embedded_gguf.name)


def test_ids_match_transformers_and_round_trip(tok: Tokenizer, ref: PreTrainedTokenizerFast) -> None:
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id == 2 and ids.count(2) == 1
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text


def test_ids_match_llama_cpp_style_sentencepiece(tok: Tokenizer, embedded_gguf: Path) -> None:
    """An independent oracle: llama.cpp's SPM algorithm over the GGUF vocabulary (control and
    user-defined tokens matched whole first, then best-score bigram merges, then byte fallback)."""
    meta = read_gguf_header(embedded_gguf, string_arrays=("tokenizer.ggml.tokens",)).metadata
    tokens, scores, types = (
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.scores"],
        meta["tokenizer.ggml.token_type"],
    )
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    whole = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)

    def spm(text: str) -> list[int]:
        symbols = list(text.replace(" ", "\u2581"))
        while True:
            pairs = [
                (scores[vocab[a + b]], -i)
                for i, (a, b) in enumerate(itertools.pairwise(symbols))
                if a + b in vocab
            ]
            if not pairs:
                break
            i = -max(pairs)[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        return [
            j
            for s in symbols
            for j in ([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])
        ]

    def oracle(text: str) -> list[int]:
        parts: list[str | int] = [text]
        for t in whole:
            parts = [q for p in parts for q in (_split(p, t, vocab[t]) if isinstance(p, str) else [p])]
        return [j for p in parts for j in (spm(p) if isinstance(p, str) else [p])]

    for text in [*TEXTS, "<start_of_turn>user\nHi  there<end_of_turn>\n", "x\n\n\n  y"]:
        assert tok.encode(text, add_special_tokens=False) == oracle(text), text


def _split(text: str, token: str, token_id: int) -> list[str | int]:
    out: list[str | int] = []
    for k, piece in enumerate(text.split(token)):
        out += ([token_id] if k else []) + ([piece] if piece else [])
    return out


def test_stop_ids_and_sizes(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == [1]  # the base model has no template, so no turn end
    assert tok.with_chat_template(GEMMA_CHAT_TEMPLATE).eos_token_ids == [1, 106]  # <eos>, <end_of_turn>
    assert tok.hf.convert_ids_to_tokens(106) == "<end_of_turn>"
    assert tok.vocab_size == 262144 and tok.bos_token_id == 2


def test_gemma_chat_template(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    tok = tok.with_chat_template(GEMMA_CHAT_TEMPLATE)
    two_turns = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a joke."}],
        },
    ]
    assert tok.apply_chat_template(two_turns) == (
        "<bos><start_of_turn>user\nHi!<end_of_turn>\n"
        "<start_of_turn>model\nHello, how can I help?<end_of_turn>\n"
        "<start_of_turn>user\nTell me a joke.<end_of_turn>\n<start_of_turn>model\n"
    )
    system = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "  Why?  "}]
    text = tok.apply_chat_template(system, add_generation_prompt=False)
    assert text == "<bos><start_of_turn>user\nAnswer briefly.\n\nWhy?<end_of_turn>\n"
    ids = tok.encode(text)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1  # the template's <bos> is not doubled
    with pytest.raises(ValueError, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    for bad in (
        [],
        "hi",
        [{"content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "image"}]}],
    ):
        with pytest.raises(ValueError):
            tok.apply_chat_template(bad)  # type: ignore[arg-type]


def test_bad_input(tok: Tokenizer) -> None:
    for bad in (None, 3, b"bytes", ["a"]):
        with pytest.raises(ValueError, match="str"):
            tok.encode(bad)  # type: ignore[arg-type]
    for bad_ids in ("abc", [1, "2"], [1.0], [-1], [262144]):
        with pytest.raises(ValueError):
            tok.decode(bad_ids)  # type: ignore[arg-type]


def test_second_load_hits_the_cache(
    tok: Tokenizer, embedded_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = list((cache / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(tokenizer_files, "convert_into", no_conversion)
    start = time.perf_counter()
    again = Tokenizer.from_gguf(embedded_gguf)
    print(f"warm tokenizer load: {time.perf_counter() - start:.2f}s")
    assert all(again.encode(t) == tok.encode(t) for t in TEXTS)
    assert again.eos_token_ids == tok.eos_token_ids and again.chat_template == tok.chat_template


# --- small synthetic tokenizers: HF directories and GGUF files with their own templates ----------------


def test_from_hf_dir_uses_its_template_and_generation_config(tmp_path: Path) -> None:
    vocab = {"<s>": 0, "</s>": 1, "<|im_end|>": 2, "<unk>": 3, "h": 4, "i": 5, "hi": 6}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 add_bos_token=True, additional_special_tokens=["<|im_end|>"])  # fmt: skip
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    hf.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("hi") == [0, 6] and tok.encode("hi", add_special_tokens=False) == [6]
    assert tok.eos_token_ids == [1, 5, 2]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi<|im_end|>"
    with pytest.raises(ValueError, match="not found"):
        Tokenizer.from_hf_dir(tmp_path / "missing")


def test_gemma4_directory_template_ends_turns(tmp_path: Path) -> None:
    # Gemma 4 checkpoints ship their template as chat_template.jinja and end turns with <turn|>.
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|turn>": 4, "<turn|>": 5, "user": 6, "model": 7, "hi": 8}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                 pad_token="<pad>", additional_special_tokens=["<|turn>", "<turn|>"])  # fmt: skip
    hf.save_pretrained(str(tmp_path))
    template = ("{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<bos><|turn>user\nhi<turn|>\n<|turn>model\n"
    assert 5 in tok.eos_token_ids and 1 in tok.eos_token_ids


def test_gguf_chat_template_and_eot_are_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWASERVE_CACHE", str(tmp_path / "cache"))
    tokens = ["<unk>", "<s>", "</s>", "<eot>", "\u2581", "h", "i", "\u2581h", "hi", "\u2581hi"]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -0.5])
    w.add_token_types([2, 3, 3, 3, 1, 1, 1, 1, 1, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    w.add_unk_token_id(0)
    w.add_chat_template(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(tmp_path / "t.gguf")
    assert tok.eos_token_ids == [2, 3] and tok.bos_token_id == 1
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s>[user]hi"
    # the sentencepiece decoder drops the first token's word-boundary space, as HF's Llama tokenizer does
    assert tok.encode(" hi") == [1, 9] and tok.decode([1, 9, 9]) == "hi hi"
