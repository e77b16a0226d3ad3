"""IncrementalDetokenizer: turns one completion's token stream into text deltas, holding back incomplete
UTF-8 sequences and anything that may be the start of a stop string (`StopStrings`, also used on chat
replies whose content comes from a reply parser)."""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded in front of the first new token, so SentencePiece-style decoders (which strip
# the leading space of the first token they see) keep the new token's word-initial space.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one completion, produced token by token.

    Decoding: each step decodes a short window `ids[prefix_offset:]` and the part already emitted,
    `ids[prefix_offset:read_offset]`, and takes the difference. The window carries context (so a
    decoder that strips the first token's leading space, or merges byte tokens, sees the same thing
    it sees on the full sequence), and the offsets only advance when the window decodes to text not
    ending in U+FFFD, i.e. when no UTF-8 sequence is left incomplete.

    Stop strings (`StopStrings`): decoded text is released to `.text` only once no suffix of it could
    still grow into a stop string. When a stop string appears, the completion is cut just
    before it, `.stopped` becomes True and `.finish_matched` names it; no character of a stop string
    is ever released. Invariant: `.text` == concatenation of every delta returned so far.

    When a request finishes for another reason (length, EOS, stop token), call `flush()` for the
    held-back tail.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
    ):
        # The project's Tokenizer wrapper exposes the HF tokenizer as `.hf`; accept either.
        self._tokenizer = getattr(tokenizer, "hf", tokenizer)
        self._backend_decode = _backend_decode(self._tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids)
        self._prefix_offset = max(len(self._ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._num_prompt_tokens = len(self._ids)
        self._stops = StopStrings(stop)
        self.stopped = False
        self.finish_matched: str | None = None

    @property
    def text(self) -> str:
        return self._stops.text

    @property
    def stop(self) -> list[str]:
        return self._stops.stop

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_prompt_tokens :]

    def step(self, new_token_ids: list[int] | int) -> str:
        """Add generated tokens; return the newly released text (possibly ""). No-op once stopped."""
        if self.stopped:
            return ""
        if isinstance(new_token_ids, int):
            new_token_ids = [new_token_ids]
        self._ids.extend(new_token_ids)
        return self._release(self._decode_new(), final=False)

    def flush(self) -> str:
        """Release everything held back, for a completion that ended without matching a stop string.

        Bytes of a UTF-8 sequence that will now never complete come out as the tokenizer decodes them
        (U+FFFD), matching a decode of the whole sequence.
        """
        if self.stopped:
            return ""
        tail = ""
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            tail = self._decode(self._ids[self._prefix_offset :])[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(tail, final=True)

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # Shorter-or-equal: the new tokens decoded to nothing yet (e.g. skipped special tokens, or
        # leading bytes of a character); ending in U+FFFD: a character is still incomplete.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _release(self, new_text: str, final: bool) -> str:
        stops = self._stops
        release = stops.push(new_text, final)
        if stops.matched is not None:
            self.stopped, self.finish_matched = True, stops.matched
        return release


class StopStrings:
    """Stop strings over a text stream: `push` returns the text that can be released. Text is held back
    while a suffix of it could still grow into a stop string; when one appears, the text is cut just
    before it and `matched` names it (nothing more is released after that). Invariant: `.text` is the
    concatenation of everything released."""

    def __init__(self, stop: list[str] | None = None):
        self.stop = list(stop or [])
        self.text = ""
        self.matched: str | None = None
        self._pending = ""  # complete characters not yet released

    def push(self, new_text: str, final: bool = False) -> str:
        """Add text; `final`: nothing follows, so release whatever is held back (if no stop string matched)."""
        if self.matched is not None:
            return ""
        pending = self._pending + new_text
        if not self.stop:  # the common case: nothing to hold back
            self._pending = ""
            self.text += pending
            return pending
        cut, matched = _find_stop(pending, self.stop)
        if matched is not None:
            self.matched = matched
            release, self._pending = pending[:cut], ""
        else:
            hold = 0 if final else _stop_prefix_len(pending, self.stop)
            release, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self.text += release
        return release


def _backend_decode(tokenizer: Any) -> Any:
    """The Rust `tokenizers` decode behind an HF fast tokenizer, where HF's own decode adds nothing to it
    (no clean-up of tokenization spaces): half the cost of a streamed token's two decodes. None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode


def _find_stop(text: str, stops: list[str]) -> tuple[int, str | None]:
    """Earliest occurrence of any stop string in `text`: (start index, the stop string) or (-1, None)."""
    best, matched = -1, None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best == -1 or i < best):
            best, matched = i, s
    return best, matched


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    Text before that suffix can be released safely: any stop string that could still complete must
    start inside it (a longer suffix would itself be such a prefix).
    """
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
