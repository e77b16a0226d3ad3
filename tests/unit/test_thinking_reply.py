"""Thinking blocks (swaserve/chat/thinking.py): Gemma 4's `<|channel>thought\n...<channel|>` and MiMo-V2's
`<think>...</think>` replies split into reasoning and content, whole and token by token, over a byte-level
tokenizer (characters split across tokens) that has the markers as special tokens. The replies are written
in the formats the models' parsers document (vLLM's gemma4 / SGLang's mimo), not recorded from the models."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from swaserve.chat import ParsedReply, RawReply, ThinkingChat, chat_for
from swaserve.chat.thinking import GEMMA4, THINK_TAGS, ThinkingReplyParser

GEMMA4_REPLY = "<|channel>thought\nThe user asks for 17 × 3. 17 × 3 = 51.<channel|>17 × 3 = **51**."
MIMO_REPLY = "Let me check: 你好 means hello. 🎉</think>\n\n你好 means “hello”."


class _Tok:
    """The project's Tokenizer surface the chat formats read: `.hf`, `.chat_format`."""

    chat_format = None

    def __init__(self, hf: PreTrainedTokenizerFast):
        self.hf = hf

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)


def _tokenizer(markers: tuple[str, ...]) -> _Tok:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", *markers],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the user asks thought", "hello means"], trainer)
    return _Tok(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>"))


@pytest.fixture(scope="module")
def gemma4() -> _Tok:
    return _tokenizer(("<|channel>", "<channel|>", "<turn|>"))


@pytest.fixture(scope="module")
def mimo() -> _Tok:
    return _tokenizer(("<think>", "</think>", "<|im_end|>"))


def _parser(tok: _Tok, prompt: list[int] | None = None) -> ThinkingReplyParser:
    chat = chat_for(tok)
    assert isinstance(chat, ThinkingChat)
    parser = chat.reply_parser(True, prompt)
    assert isinstance(parser, ThinkingReplyParser)
    return parser


def _stream(parser: ThinkingReplyParser, ids: list[int]) -> list[tuple[str, str]]:
    deltas = [parser.feed([t]) for t in ids] + [parser.finish()]
    return [(d.reasoning, d.content) for d in deltas]


def test_formats_are_detected_from_the_vocabulary(gemma4, mimo) -> None:
    assert chat_for(gemma4).format is GEMMA4 and chat_for(mimo).format is THINK_TAGS
    assert chat_for(gemma4).has_reasoning
    plain = _tokenizer(())
    assert not chat_for(plain).has_reasoning


def test_gemma4_whole_and_streamed(gemma4) -> None:
    ids = gemma4.encode(GEMMA4_REPLY)
    whole = _parser(gemma4).feed(ids)
    rest = _parser(gemma4)
    deltas = _stream(rest, ids)
    reasoning = "".join(r for r, _ in deltas)
    content = "".join(c for _, c in deltas)
    assert reasoning == "The user asks for 17 × 3. 17 × 3 = 51."  # the "thought\n" label is not reasoning
    assert content == "17 × 3 = **51**."
    assert (whole.reasoning, whole.content) == (reasoning, content)
    last_reasoning = max(i for i, (r, _) in enumerate(deltas) if r)
    first_content = min(i for i, (_, c) in enumerate(deltas) if c)
    assert last_reasoning < first_content  # every reasoning delta comes before the answer
    assert all("<" not in r + c for r, c in deltas)  # no marker leaks


@pytest.mark.parametrize("reply,reasoning,content", [
    ("<|channel>thoughtful remarks<channel|>ok", "thoughtful remarks", "ok"),  # not the label: kept
    ("<|channel>though", "though", ""),  # never closed, shorter than the label: reasoning at the end
    ("Just the answer.", "", "Just the answer."),  # thinking off: content only
    ("<channel|>stray end<|channel>thought\nx<|channel>y<channel|>z", "xy", "stray endz"),  # out-of-place markers
])
def test_gemma4_edge_cases(gemma4, reply: str, reasoning: str, content: str) -> None:
    deltas = _stream(_parser(gemma4), gemma4.encode(reply))
    assert ("".join(r for r, _ in deltas), "".join(c for _, c in deltas)) == (reasoning, content)


def test_mimo_block_opened_by_the_prompt(mimo) -> None:
    """MiMo's template with enable_thinking ends the prompt inside <think>: the reply starts as reasoning;
    one with thinking off writes an empty <think></think>, so the reply is all content."""
    ids = mimo.encode(MIMO_REPLY)
    thinking_prompt = mimo.encode("<|im_end|>assistant\n<think>")
    deltas = _stream(_parser(mimo, thinking_prompt), ids)
    assert "".join(r for r, _ in deltas) == "Let me check: 你好 means hello. 🎉"
    assert "".join(c for _, c in deltas) == "\n\n你好 means “hello”."
    plain_prompt = mimo.encode("assistant\n<think></think>")
    deltas = _stream(_parser(mimo, plain_prompt), mimo.encode("你好 means hello."))
    assert deltas and all(not r for r, _ in deltas) and "".join(c for _, c in deltas) == "你好 means hello."


def test_mimo_reply_with_its_own_start_tag(mimo) -> None:
    deltas = _stream(_parser(mimo), mimo.encode("<think>short</think>answer"))
    assert ("".join(r for r, _ in deltas), "".join(c for _, c in deltas)) == ("short", "answer")


def test_stop_strings_apply_to_the_content_only(gemma4) -> None:
    reply = ParsedReply(_parser(gemma4), stop=["51"])
    for t in gemma4.encode(GEMMA4_REPLY):
        reply.step(t)
        if reply.stopped:
            break
    assert reply.stopped and reply.text == "17 × 3 = **"
    assert reply.reasoning == "The user asks for 17 × 3. 17 × 3 = 51."


def test_reasoning_left_in_content(gemma4) -> None:
    parser = chat_for(gemma4).reply_parser(separate_reasoning=False)
    assert isinstance(parser, RawReply)
    ids = gemma4.encode(GEMMA4_REPLY)
    out = [parser.feed([t]) for t in ids] + [parser.finish()]
    assert "".join(d.content for d in out) == GEMMA4_REPLY and not any(d.reasoning for d in out)


def test_chat_template_kwargs_open_the_block(mimo) -> None:
    """`chat_template_kwargs` reach the template (MiMo's `enable_thinking` opens <think> in the prompt), the
    reply parser then starts inside the block; the rendering's own arguments cannot be overridden."""
    from swaserve.tokenizer import Tokenizer

    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}assistant\n"
                "{% if enable_thinking %}<think>{% else %}<think></think>{% endif %}")
    chat = chat_for(Tokenizer(mimo.hf, template))
    assert isinstance(chat, ThinkingChat)
    msgs = [{"role": "user", "content": "hi"}]
    on = chat.prompt_ids(msgs, template_kwargs={"enable_thinking": True})
    off = chat.prompt_ids(msgs)
    assert on[-1] == chat.start_id and off[-1] == chat.end_id
    reply = mimo.encode("ok</think>hello")
    for prompt, want in ((on, ("ok", "hello")), (off, ("", "okhello"))):
        d = chat.reply_parser(True, prompt).feed(reply)
        assert (d.reasoning, d.content) == want
    with pytest.raises(ValueError, match="add_generation_prompt"):
        chat.prompt_ids(msgs, template_kwargs={"add_generation_prompt": False})
