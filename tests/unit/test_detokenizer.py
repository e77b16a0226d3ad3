"""IncrementalDetokenizer against tokenizers built offline: byte-level BPE and SentencePiece-style
(Metaspace + byte fallback) with two decoder pipelines. Tokens are fed one at a time."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from swaserve.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, this is a tiny corpus.",
    "The quick brown fox jumps over the lazy dog.",
    "stop here STOP now and then",
    "multiple   spaces   here",
    "numbers 123 456",
] * 20

TEXTS = [
    "Hello world, this is a tiny corpus.",
    "你好 🎉 héllo wörld 日本語テキスト",
    "multiple   spaces   here  and\ttabs\n\nnewlines",
    "🎉🎉👩‍👩‍👧 emoji run",
    "  leading spaces",
    "ascii then 中文 then ascii",
]


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _sentencepiece_style(decoder: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    # Add the 256 `<0xNN>` byte tokens as ordinary (non-special) vocab entries, as Llama/Gemma do.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    if decoder == "metaspace":
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    else:  # Llama's pipeline: the leading-space strip runs once, on the fused string
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte_level_bpe", "sp_metaspace", "sp_llama"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    if request.param == "byte_level_bpe":
        return _byte_level_bpe()
    return _sentencepiece_style(request.param.removeprefix("sp_"))


def _stream(
    tok, prompt_ids: list[int], out_ids: list[int], stop: list[str] | None = None
) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=stop)
    deltas = []
    for t in out_ids:
        deltas.append(detok.step([t]))
        assert "\ufffd" not in deltas[-1]
        assert detok.text == "".join(deltas)
        if detok.stopped:
            break
    return detok, deltas


def test_tokenizers_really_split_characters(tokenizer) -> None:
    # Guards the tests below: multi-byte characters must be split across tokens to be exercised.
    ids = tokenizer.encode("你好 🎉", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) or tokenizer.decode([i]) == "" for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_equal_full_decode_without_prompt(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = _stream(tokenizer, [], ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.flush() == ""


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["Hello world", "The quick 狐", "ends with space "])
def test_deltas_continue_the_prompt(tokenizer, text: str, prompt: str) -> None:
    # The first generated token must neither lose nor gain its leading space.
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    out_ids = tokenizer.encode(" " + text, add_special_tokens=False)
    full = tokenizer.decode(prompt_ids + out_ids, skip_special_tokens=True)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(prompt_text)
    detok, deltas = _stream(tokenizer, prompt_ids, out_ids)
    assert "".join(deltas) == full[len(prompt_text) :]
    assert deltas[0].startswith(" ") or deltas[0] == ""


def test_incomplete_character_is_held_back() -> None:
    tok = _sentencepiece_style("llama")
    ids = tok.encode("a你", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[-3:] == ["<0xE4>", "<0xBD>", "<0xA0>"]
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.step([t]) for t in ids]
    assert deltas[-3:] == ["", "", "你"]


def test_flush_releases_a_never_completed_character() -> None:
    tok = _sentencepiece_style("llama")
    ids = tok.encode("ab你", add_special_tokens=False)[:-1]  # drop the last byte
    detok, deltas = _stream(tok, [], ids)
    assert "".join(deltas) == "ab"
    assert detok.text + detok.flush() == tok.decode(ids)


def test_special_tokens_are_skipped(tokenizer) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok, deltas = _stream(tokenizer, [], ids)
    assert "".join(deltas) == "Hello world"


def test_accepts_wrapper_with_hf_attribute() -> None:
    tok = _byte_level_bpe()
    wrapper = type("Wrapper", (), {"hf": tok})()
    ids = tok.encode("Hello world", add_special_tokens=False)
    _, deltas = _stream(wrapper, [], ids)
    assert "".join(deltas) == "Hello world"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("Hello world, this is a tiny corpus.", [", th"], "Hello world"),  # spans tokens
        ("Hello world, this is a tiny corpus.", ["Hello"], ""),  # at the very start
        ("Hello world, this is a tiny corpus.", ["H"], ""),
        ("Hello world, this is a tiny corpus.", ["tiny", "is a"], "Hello world, this "),  # earliest wins
        ("你好 🎉 héllo wörld", ["🎉"], "你好 "),  # multi-byte stop string
        ("你好 🎉 héllo wörld", ["好 🎉 h"], "你"),
        ("multiple   spaces   here", ["   here"], "multiple   spaces"),
    ],
)
def test_stop_string_truncates_and_is_never_emitted(tokenizer, text, stop, expected) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = _stream(tokenizer, [], ids, stop=stop)
    assert detok.stopped and detok.finish_matched in stop
    assert "".join(deltas) == detok.text == expected
    assert detok.step(ids[:1]) == "" and detok.flush() == "" and detok.text == expected


def test_partial_stop_is_held_then_released(tokenizer) -> None:
    text = "Hello world, this is a tiny corpus"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, deltas = _stream(tokenizer, [], ids, stop=["world peace", "corpus."])
    assert not detok.stopped
    assert detok.text == "Hello world, this is a tiny "  # "corpus" might still become "corpus."
    assert detok.flush() == "corpus"
    assert detok.text == text


def test_held_text_never_leaks_part_of_a_stop_string(tokenizer) -> None:
    # Property: for random stop strings cut out of the text, the released text is always a prefix of
    # the text before the first occurrence, and ends exactly there.
    rng = random.Random(0)
    for source in TEXTS:
        ids = tokenizer.encode(source, add_special_tokens=False)
        text = tokenizer.decode(ids)  # SentencePiece decoders drop the first leading space
        for _ in range(8):
            start = rng.randrange(len(text))
            stop = text[start : start + rng.randint(1, 6)]
            expected = text[: text.find(stop)]
            detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
            for t in ids:
                detok.step([t])
                assert expected.startswith(detok.text)
            assert detok.stopped and detok.text == expected, (text, stop)
