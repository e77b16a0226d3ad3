"""Structured outputs through xgrammar: constraints checked and compiled against the model's vocabulary
(`GrammarCompiler`, with an LRU of compiled grammars), one matcher per sequence (`SequenceGrammar`, advanced a step's rows at a time by `accept_tokens`, or
`accept_later` and a worker thread), and
the per-step allowed-token bitmasks of a batch's constrained rows (`start_fill`, `fill_token_masks`), which
the launcher applies to the logits on the device."""

from swaserve.grammar.compiler import GrammarCompiler, check_constraint
from swaserve.grammar.masks import MaskJob, MaskRows, TokenMasks, fill_token_masks, start_fill
from swaserve.grammar.matcher import PendingAccept, SequenceGrammar, accept_later, accept_tokens

__all__ = ["GrammarCompiler", "MaskJob", "MaskRows", "PendingAccept", "SequenceGrammar", "TokenMasks", "accept_later",
           "accept_tokens", "check_constraint", "fill_token_masks", "start_fill"]
