"""GPT-OSS chat in harmony format: the o200k vocabulary regenerated from the model's tokenizer.json (exact
file, harmony accepts it) and the other ways to it, conversations rendered by openai-harmony, and replies
split into reasoning and content through the reply-parser interface, token by token or in chunks."""

from __future__ import annotations

import datetime
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harmony_model import gpt_oss_dir, o200k_file

from swaserve.chat import ParsedReply, ReplyDelta, chat_for
from swaserve.chat.harmony import HarmonyChat, HarmonyReplyParser, load_encoding
from swaserve.chat.o200k import ENV, SHA256, o200k_from_vocab, vocab_dir
from swaserve.chat.reply import RawReply
from swaserve.tokenizer import Tokenizer

DAY = datetime.date(2026, 1, 2)
ANALYSIS = "The user greets me in French: répondre brièvement 😀. Stop here? No."
FINAL = "Bonjour ! 東京 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, how can I help?"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_hf_dir(gpt_oss_dir())


@pytest.fixture(scope="module")
def chat(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> HarmonyChat:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWASERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.delenv(ENV, raising=False)  # the model's own vocabulary, regenerated
        return HarmonyChat(tok, today=lambda: DAY)


def reply_ids(chat: HarmonyChat, text: str) -> list[int]:
    return list(chat.encoding.encode(text, allowed_special="all"))


def split(chat: HarmonyChat, ids: list[int], chunks: list[int] | None = None, stop: list[str] | None = None,
          separate: bool = True) -> tuple[str, str, ParsedReply]:
    """Feed `ids` in chunks of the given sizes (default: one token at a time); (reasoning, content, reply)."""
    reply = ParsedReply(chat.reply_parser(separate), stop=stop)
    i, sizes = 0, iter(chunks or [])
    while i < len(ids) and not reply.stopped:
        n = next(sizes, 1)
        reply.step(ids[i : i + n])
        i += n
    reply.flush()
    return reply.reasoning, reply.text, reply


def test_o200k_regenerated_from_tokenizer_json_is_the_exact_file(tok: Tokenizer) -> None:
    vocab = tok.hf.backend_tokenizer.get_vocab(with_added_tokens=False)
    assert o200k_from_vocab(vocab) == o200k_file().read_bytes()
    broken = dict(vocab)
    a, b = (t for t, i in vocab.items() if i in (1000, 1001))
    broken[a], broken[b] = broken[b], broken[a]
    fake = SimpleNamespace(hf=SimpleNamespace(backend_tokenizer=SimpleNamespace(get_vocab=lambda **_: broken)))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENV, raising=False)
        with pytest.raises(ValueError, match=f"does not hold o200k_base's ranks.*set \\${ENV}"):
            load_encoding(fake)


def test_vocab_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: Tokenizer) -> None:
    def vocab() -> dict[str, int]:
        return tok.hf.backend_tokenizer.get_vocab(with_added_tokens=False)  # type: ignore[no-any-return]

    real = o200k_file()
    monkeypatch.delenv(ENV, raising=False)
    cache = tmp_path / "cache"
    assert vocab_dir(vocab, cache) == cache and (cache / "o200k_base.tiktoken").read_bytes() == real.read_bytes()
    monkeypatch.setenv(ENV, str(real.parent))  # the variable wins: nothing regenerated
    assert vocab_dir(lambda: pytest.fail("regenerated"), tmp_path / "unused") == real.parent
    monkeypatch.setenv(ENV, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=f"\\${ENV} is .* holds no o200k_base.tiktoken"):
        vocab_dir(vocab, cache)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "o200k_base.tiktoken").write_bytes(real.read_bytes().replace(b"IQ== 0", b"Ig== 0"))
    monkeypatch.setenv(ENV, str(bad))
    with pytest.raises(ValueError, match=f"could not load .*hash mismatch.*\\${ENV} must name"):
        load_encoding(tok)
    assert os.environ[ENV] == str(bad)  # restored after loading


def test_gpt_oss_tokenizer_is_recognised_by_config(tok: Tokenizer) -> None:
    assert tok.chat_format == "harmony" and tok.vocab_size == 201_088
    # The directory's template writes <|end|> (200007), which closes the analysis message inside a reply:
    # not a stop id, unlike other templates' turn ends. generation_config's ids are.
    assert "<|end|>" in (tok.chat_template or "") and tok.eos_token_ids == [200002, 199999, 200012]
    with pytest.raises(ValueError, match="harmony format"):
        tok.with_chat_template("{{ messages }}")


def test_render(chat: HarmonyChat, tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "encore"}]
    ids = chat.prompt_ids(msgs, reasoning_effort="high")
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2026-01-02\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer in French.<|end|>"
        "<|start|>user<|message|>hello<|end|><|start|>assistant<|channel|>final<|message|>Bonjour.<|end|>"
        "<|start|>user<|message|>encore<|end|><|start|>assistant")
    assert chat.prompt_ids(msgs) != ids and b"Reasoning: medium" in tok.decode(chat.prompt_ids(msgs)).encode()
    assert chat.stop_token_ids == [200002, 200012]  # <|return|>, <|call|>; <|end|> is not one
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        chat.prompt_ids(msgs, reasoning_effort="max")
    with pytest.raises(ValueError, match="tool message needs the tool_call_id"):
        chat.prompt_ids([{"role": "tool", "content": "x"}])


def test_directory_template_gives_harmony_ids_without_instructions(
    chat: HarmonyChat, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory's template and harmony agree token for token on user/assistant turns (so the HF
    tokenizer encodes harmony text as harmony does); the server renders with harmony either way."""
    msgs = [{"role": "user", "content": "Naïve 東京 😀\n\n  spaces"}, {"role": "assistant", "content": "Oui."},
            {"role": "user", "content": "x"}]
    monkeypatch.setattr(chat, "today", datetime.date.today)  # the template's strftime_now
    assert chat.prompt_ids(msgs) == tok.encode(tok.apply_chat_template(msgs))


def test_reply_split_token_by_token_and_in_chunks(chat: HarmonyChat) -> None:
    ids = reply_ids(chat, f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
                          f"<|start|>assistant<|channel|>final<|message|>{FINAL}")  # <|return|>: the engine's stop
    assert split(chat, ids)[:2] == (ANALYSIS, FINAL)
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 7) for _ in ids]
        assert split(chat, ids, sizes)[:2] == (ANALYSIS, FINAL), sizes
    assert split(chat, ids, [len(ids)])[:2] == (ANALYSIS, FINAL)
    # The deltas themselves: reasoning first, then content, never both from one token.
    parser = chat.reply_parser()
    deltas = [parser.feed([t]) for t in ids]
    assert all(not (d.reasoning and d.content) for d in deltas)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(d.reasoning for d in deltas[first_content:]) and parser.finish() == ReplyDelta()
    # Cut short (max_tokens) inside the analysis: reasoning only.
    assert split(chat, ids[:9])[:2] == (chat.encoding.decode(ids[3:9]), "")


def test_stop_strings_apply_to_the_content(chat: HarmonyChat) -> None:
    ids = reply_ids(chat, f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>"
                          f"<|start|>assistant<|channel|>final<|message|>{FINAL}")
    reasoning, content, reply = split(chat, ids, stop=["Stop here", "how can"])
    assert reasoning == ANALYSIS and content == FINAL[: FINAL.index("how can")]
    assert reply.stopped and reply.finish_matched == "how can"


def test_reasoning_left_in_content(chat: HarmonyChat) -> None:
    text = f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}"
    assert isinstance(chat.reply_parser(separate_reasoning=False), RawReply)
    assert split(chat, reply_ids(chat, text), separate=False)[:2] == ("", text)


def test_commentary_and_broken_replies(chat: HarmonyChat) -> None:
    call = reply_ids(chat, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
                           "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}")
    parser = chat.reply_parser()
    assert isinstance(parser, HarmonyReplyParser)
    assert parser.feed(call) == ReplyDelta("Need weather.", "")  # the call's arguments are not shown
    parser.feed(reply_ids(chat, "<|call|>"))
    assert parser.messages[-1].recipient == "functions.get_weather"  # kept for tool calls
    preamble = reply_ids(chat, "<|channel|>commentary<|message|>Checking the weather now.<|end|>")
    assert split(chat, preamble)[:2] == ("", "Checking the weather now.")
    # Not harmony at all (a random-weight model): the rest continues as content, markers and all.
    broken = reply_ids(chat, "<|channel|>final<|message|>ok<|end|>plain words<|message|> more")
    assert split(chat, broken)[:2] == ("", "okplain words<|message|> more")
    # No message ever opened (harmony takes it all for a header): the reply as written, at its end.
    assert split(chat, reply_ids(chat, "Just words<|end|>, no header"))[:2] == ("", "Just words<|end|>, no header")


def test_chat_for_picks_the_format(tok: Tokenizer, chat: HarmonyChat) -> None:
    plain = chat_for(SimpleNamespace(apply_chat_template=lambda m, add_generation_prompt: "x",
                                     encode=lambda text: [1, 2]))
    assert not plain.has_reasoning and plain.reply_parser() is None and plain.prompt_ids([]) == [1, 2]
    with pytest.raises(ValueError, match="reasoning_effort applies only"):
        plain.prompt_ids([], reasoning_effort="low")
    assert chat.has_reasoning and SHA256.startswith("446a95")


def test_tools_rendered_and_calls_parsed(chat: HarmonyChat, tok: Tokenizer) -> None:
    """Tools in the developer message, earlier calls and results as commentary messages; a reply's call
    (the commentary channel to `functions.<name>`, ended by <|call|>, a stop id the parser never sees)
    comes out as a tool call beside the reasoning."""
    from swaserve.server.tools import ToolReply, tool_plan

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "rain"}'}]
    text = tok.decode(chat.prompt_ids(msgs, tools=tools), skip_special_tokens=False)
    assert "namespace functions" in text and "type get_weather = (_: {" in text and "Weather of a city." in text
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
            '{"city":"Oslo"}<|call|>') in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sky": "rain"}' in text
    reply = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
             'to=functions.get_weather <|constrain|>json<|message|>{"city": "Bergen"}')
    ids = reply_ids(chat, reply)
    out = ToolReply(ParsedReply(chat.reply_parser(True)), tool_plan(tools, "auto", None), "hermes")
    for i in range(0, len(ids), 3):
        out.step(ids[i : i + 3])
    out.flush()
    assert out.reasoning == "Need the weather." and out.text == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out.calls] == [
        ("get_weather", '{"city": "Bergen"}')]
